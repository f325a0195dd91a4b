"""The one denoising loop and the one re-noise rule (``dit.sampler``, issue 30 item 1): their
semantics, and source checks that catch a second copy of either coming back."""

from __future__ import annotations

import ast
from pathlib import Path

import torch
from sakura.dit.sampler import EulerSteps, Trajectory, denoise, renoise, schedule

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("dit", "edge", "codec", "cloud", "traces", "sakura")


def test_renoise_is_the_rectified_flow_interpolation():
    x0, e = torch.randn(1, 4, 3), torch.randn(1, 4, 3)
    assert torch.equal(renoise(x0, e, 0.0), x0)
    assert torch.equal(renoise(x0, e, 1.0), e)
    t = torch.tensor([0.25])
    assert torch.equal(renoise(x0, e, t), (1 - t) * x0 + t * e)


def test_denoise_order_of_hooks_and_no_in_place_write():
    ts = schedule(3)
    x0, e = torch.zeros(1, 4, 2), torch.ones(1, 4, 2)
    x = torch.full((1, 4, 2), 5.0)
    start = x.clone()
    rows = torch.tensor([0, 2])
    calls: list[tuple] = []

    def model_step(s, t, xs):
        calls.append(("model", s, float(t)))
        # the pinned rows were re-noised to the step's t before the model sees the latent
        assert torch.equal(xs[:, rows], renoise(x0, e, ts[s])[:, rows])
        return torch.full_like(xs, 2.0)

    out = denoise(x, EulerSteps(ts), model_step, guide=lambda v: v * 0.5,
                  pinned=Trajectory(x0, e, rows), start=1,
                  before_step=lambda s, xs: calls.append(("before", s)),
                  after_step=lambda s: calls.append(("after", s)))
    assert torch.equal(x, start)  # the caller's latent is not written
    assert [c[:2] for c in calls] == [("before", 1), ("model", 1), ("after", 1),
                                      ("before", 2), ("model", 2), ("after", 2)]
    # last step: pinned rows at ts[2], then x + (ts[3] - ts[2]) * (0.5 * 2)
    want = renoise(x0, e, ts[2])[:, rows] + (ts[3] - ts[2]) * 1.0
    assert torch.equal(out[:, rows], want)


def test_template_run_mode_follows_the_trajectory_without_update():
    ts = schedule(4)
    x0, e = torch.randn(1, 3, 2), torch.randn(1, 3, 2)
    seen = []
    denoise(x0, EulerSteps(ts), lambda s, t, xt: seen.append(xt), pinned=Trajectory(x0, e),
            integrate=False)
    assert len(seen) == 4
    for s, xt in enumerate(seen):
        assert torch.equal(xt, renoise(x0, e, ts[s]))


# ----------------------------------------------------------------------------- one copy


def _sources():
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            yield path, ast.parse(path.read_text(), str(path))


def _is_renoise(node: ast.AST) -> bool:
    """``(1 - t) * a + t * b`` (either operand order of each product)."""
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add)):
        return False
    left, right = node.left, node.right
    if not all(isinstance(p, ast.BinOp) and isinstance(p.op, ast.Mult) for p in (left, right)):
        return False
    for one_minus in (left.left, left.right):
        if (isinstance(one_minus, ast.BinOp) and isinstance(one_minus.op, ast.Sub)
                and isinstance(one_minus.left, ast.Constant) and one_minus.left.value in (1, 1.0)):
            t = ast.dump(one_minus.right)
            if t in (ast.dump(right.left), ast.dump(right.right)):
                return True
    return False


def _euler_loops(tree: ast.AST) -> list[int]:
    """Lines of ``for`` loops that step a latent themselves: an Euler step ``x = x + (t1 -
    t0) * v``, a scheduler's ``.step(..., return_dict=False)``, or a walk over a
    scheduler's ``sigmas[...]`` / ``timesteps[...]``."""
    out = []
    for loop in ast.walk(tree):
        if not isinstance(loop, ast.For):
            continue
        for node in ast.walk(loop):
            if (isinstance(node, ast.Assign) and len(node.targets) == 1
                    and isinstance(node.targets[0], ast.Name)
                    and isinstance(node.value, ast.BinOp) and isinstance(node.value.op, ast.Add)
                    and isinstance(node.value.left, ast.Name)
                    and node.value.left.id == node.targets[0].id
                    and isinstance(node.value.right, ast.BinOp)
                    and isinstance(node.value.right.op, ast.Mult)
                    and isinstance(node.value.right.left, ast.BinOp)
                    and isinstance(node.value.right.left.op, ast.Sub)):
                out.append(loop.lineno)
                break
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "step"
                    and any(k.arg == "return_dict" for k in node.keywords)):
                out.append(loop.lineno)
                break
            if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute)
                    and node.value.attr in ("sigmas", "timesteps")):
                out.append(loop.lineno)
                break
    return out


def test_the_detectors_see_the_former_copies():
    old = ast.parse("""
for s in range(n):
    x[:, u] = ((1 - t) * x0 + t * e)[:, u]
    x = x + (ts[s + 1] - t) * v
for s in range(n):
    x = sched.step(v, t, x, return_dict=False)[0].float()
for s in range(n):
    sigma = float(sched.sigmas[s])
    y = (1 - sigma) * x0 + sigma * e
""")
    assert sum(_is_renoise(n) for n in ast.walk(old)) == 2
    assert _euler_loops(old) == [2, 5, 7]


def test_one_renoise_rule():
    found = [f"{path.relative_to(ROOT)}:{node.lineno}" for path, tree in _sources()
             for node in ast.walk(tree) if _is_renoise(node)]
    assert found == ["dit/sampler.py:" + str(_renoise_line())], found


def _renoise_line() -> int:
    tree = ast.parse((ROOT / "dit" / "sampler.py").read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "renoise")
    return next(n.lineno for n in ast.walk(fn) if _is_renoise(n))


def test_one_denoising_loop():
    found = [f"{path.relative_to(ROOT)}:{line}" for path, tree in _sources()
             for line in _euler_loops(tree)]
    tree = ast.parse((ROOT / "dit" / "sampler.py").read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "denoise")
    assert _euler_loops(fn) == [], "the loop updates through Steps.step, not inline"
    assert found == [], found
