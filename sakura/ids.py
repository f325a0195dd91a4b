"""The template-id rule, defined once for every package that checks one.

The catalog (``dit/templates.py``), the pack manifest (``codec/manifest.py``: the pydantic
model and its JSON Schema), the server's URL layout (``cloud/layout.py``) and the device
client (``edge/client.py``) all accept exactly these ids. It lives in the shared ground
because ``dit`` and ``codec`` import nothing of each other (``tests/test_layering.py``).
Shared ground: imports nothing of SAKURA.
"""

from __future__ import annotations

import re

TEMPLATE_ID_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,63}$"
TEMPLATE_ID = re.compile(TEMPLATE_ID_PATTERN)
