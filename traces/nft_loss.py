"""Real packet loss on the kernel link: nftables drop rules in both namespaces.

Loss is real (``loss`` > 0, the impairment's loss by default): the kernel has nf_tables with
``numgen``, so an nftables table :data:`LOSS_TABLE` in each namespace drops every IP packet
arriving on the veth with probability ``loss`` (``numgen random mod`` :data:`LOSS_MODULUS`):
server -> client in the client namespace, after tbf (a lost packet has used the bottleneck,
as on a radio link), client -> server in the server namespace. Drops are on the receiving
side because a drop in the sender's output hook is reported to the sending socket (TCP
would see a local error, not a lost packet). While loss is on, both veth ends carry one TCP
segment per packet (``gso_max_segs 1``), so each segment is lost on its own, not up to 45
in one GSO packet (the kernel link's shaped end always does: ``one_frame_always``). TCP really retransmits (fast retransmit, tail-loss probes, timeouts);
the relay's loss model (:mod:`traces.impair`) is then off (the relay gets loss 0). With
``real_loss=False`` the relay models loss instead (the former behaviour). The link's
``conditions()`` names the mechanism (``loss_mechanism``). The table goes when the link
stops (the namespaces are deleted as well).

Needs ``nft`` (Debian package ``nftables``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import shutil
import subprocess
from collections.abc import Callable

from sakura.traces.errors import LinkError
from sakura.traces.namespaces import PREFIX, kernel_shaping_unavailable_reason, run_cmd

#: nftables table (family ``inet``) holding a namespace's loss rules
LOSS_TABLE = "sakura_loss"
#: ``numgen random mod LOSS_MODULUS < round(loss x LOSS_MODULUS)``: loss in steps of 1e-6
LOSS_MODULUS = 1_000_000
#: ``loss_mechanism`` of a kernel link whose loss is real
REAL_LOSS = "nftables numgen random drop, both directions"
#: veth ``gso_max_segs`` while loss is on (one segment per packet) and the kernel's default
LOSS_GSO_MAX_SEGS = 1
DEFAULT_GSO_MAX_SEGS = 65535


def check_loss(loss: float) -> float:
    """A loss rate in [0, 0.5), or a :class:`LinkError`."""
    if not (isinstance(loss, (int, float)) and math.isfinite(loss) and 0 <= loss < 0.5):
        raise LinkError(f"loss must be a rate in [0, 0.5), got {loss!r}")
    return float(loss)



def real_loss_unavailable_reason() -> str | None:
    """Why the kernel link cannot drop packets here (None when it can): kernel shaping,
    ``nft`` and an nftables ``numgen`` rule in a probe namespace."""
    reason = kernel_shaping_unavailable_reason()
    if reason is not None:
        return reason
    if shutil.which("nft") is None:
        return "real loss needs the 'nft' command (Debian package nftables)"
    name = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(3)}-srv"
    try:
        res = run_cmd(["ip", "netns", "add", name])
        if res.returncode != 0:
            return f"'ip netns add' failed: {res.stderr.strip() or res.returncode}"
        res = run_cmd(["ip", "netns", "exec", name, "nft", "-f", "-"],
                      input=loss_rules("lo", 0.01, "probe"))
        if res.returncode != 0:
            return f"nftables numgen drop rules are not available: {res.stderr.strip()}"
    except (OSError, subprocess.SubprocessError) as exc:
        return f"cannot run ip/nft: {exc}"
    finally:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            run_cmd(["ip", "netns", "del", name])
    return None


def loss_rules(dev: str, loss: float, direction: str) -> str:
    """One nft transaction: (re)create :data:`LOSS_TABLE` with an input chain that counts
    the IP packets arriving on ``dev`` and drops each with probability ``loss``."""
    threshold = int(round(loss * LOSS_MODULUS))
    return (
        f"add table inet {LOSS_TABLE}\n"
        f"flush table inet {LOSS_TABLE}\n"
        f"add chain inet {LOSS_TABLE} input {{ type filter hook input priority filter; "
        "policy accept; }\n"
        f'add rule inet {LOSS_TABLE} input iifname "{dev}" counter comment "{direction} seen"\n'
        f'add rule inet {LOSS_TABLE} input iifname "{dev}" numgen random mod {LOSS_MODULUS} '
        f'< {threshold} counter drop comment "{direction} dropped"\n'
    )


class NftLoss:
    """The drop rules of a namespace pair. ``legs``: (namespace, receiving veth end,
    direction) of each direction's rules; ``applied``: the loss the rules drop now (0: no
    rules installed)."""

    def __init__(self, legs: tuple[tuple[str, str, str], ...],
                 one_frame_always: tuple[str, ...] = ()) -> None:
        self.legs = legs
        #: veth ends that carry one segment per packet with or without loss (the shaped
        #: one: ``traces/netns.py``), so turning loss off leaves them as they are
        self.one_frame_always = one_frame_always
        self.applied = 0.0

    def set(self, must: Callable[..., None], loss: float) -> None:
        """Drop ``loss`` of the packets in both directions from now on (0: no rules);
        ``must`` runs a command and raises on failure."""
        if loss > 0 and shutil.which("nft") is None:
            raise LinkError("real loss on the kernel link needs the 'nft' command (Debian "
                            "package nftables); or real_loss=False to model it in the relay")
        was = self.applied
        if loss > 0:
            self.applied = loss  # first, so that stop() removes a half-made setup
        segs = LOSS_GSO_MAX_SEGS if loss > 0 else DEFAULT_GSO_MAX_SEGS
        for ns, dev, direction in self.legs:
            if loss > 0:
                must(["ip", "netns", "exec", ns, "nft", "-f", "-"],
                     input=loss_rules(dev, loss, direction))
            elif was > 0:
                must(["ip", "netns", "exec", ns, "nft", "delete", "table", "inet", LOSS_TABLE])
            if (loss > 0) != (was > 0) and dev not in self.one_frame_always:
                must(["ip", "-n", ns, "link", "set", "dev", dev, "gso_max_segs", str(segs)])
        self.applied = loss

    def counters(self) -> dict[str, dict[str, int]]:
        """Per direction (``down``: server -> client, ``up``), the packets the loss rules saw
        and dropped since they were last installed; empty while no rules are installed."""
        out: dict[str, dict[str, int]] = {}
        if self.applied <= 0:
            return out
        for ns, _dev, direction in self.legs:
            res = run_cmd(["ip", "netns", "exec", ns, "nft", "-j", "list", "table", "inet",
                           LOSS_TABLE])
            if res.returncode != 0:
                raise LinkError(f"cannot read the loss counters in {ns}: {res.stderr.strip()}")
            counts = {"packets": 0, "dropped": 0}
            for item in json.loads(res.stdout).get("nftables", []):
                rule = item.get("rule")
                if not rule:
                    continue
                counter = next((e["counter"] for e in rule.get("expr", []) if "counter" in e),
                               None)
                if counter is not None:
                    key = "dropped" if rule.get("comment", "").endswith("dropped") else "packets"
                    counts[key] = int(counter["packets"])
            out[direction] = counts
        return out

    def remove(self) -> None:
        """Delete the rules (errors ignored: the namespaces may be gone already)."""
        for ns, _dev, _direction in self.legs if self.applied > 0 else ():
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                run_cmd(["ip", "netns", "exec", ns, "nft", "delete", "table", "inet", LOSS_TABLE])
        self.applied = 0.0
