"""Whether the native runtime is built here: ``sakura_native`` with its edit runtime.

Light on purpose (it imports only ``sakura_native``, no torch): ``sakura edit`` checks it
with the other arguments, before any model or network work.
"""

from __future__ import annotations

from typing import Any

from sakura.edge.errors import NativeUnavailable


def native_module() -> Any:
    """``sakura_native`` with its edit runtime, or :class:`NativeUnavailable` saying why."""
    try:
        import sakura_native
    except ImportError as exc:
        raise NativeUnavailable(f"the native runtime is not built ({exc}); run "
                                "./scripts/test or ./scripts/demo once to build it, or use "
                                "--runtime python") from None
    ok, why = sakura_native.edit_runtime_available()
    if not ok:
        raise NativeUnavailable(f"sakura_native was built without the edit runtime: {why}; "
                                "use --runtime python")
    return sakura_native
