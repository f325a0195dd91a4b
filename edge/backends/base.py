"""The execution-backend interface and the on-disk cache of compiled shard graphs.

An :class:`ExecutionBackend` turns a :class:`~edge.backends.shard.ShardModule` into a
:class:`CompiledShard` (``run(*inputs) -> (txt, img)``). Backends that compile
(ExecuTorch, QNN) write an artifact folder once per :class:`ArtifactKey` (weights sha256,
model architecture, geometry, blocks, backend version) into an :class:`ArtifactCache` and
load it from there afterwards; the torch backend runs the module eagerly.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from sakura.dit.model import MMDiT
from sakura.edge.backends.errors import BackendError, GeometryMismatch
from sakura.edge.backends.shard import SHARD_FORMAT, ShardGeometry, ShardModule, example_inputs

from sakura.atomic import publish_folder
from sakura.cachedir import cache_dir as sakura_cache_dir


def weights_sha256(model: MMDiT) -> str:
    """sha256 over the model's parameters and buffers (names, dtypes, shapes, bytes)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def default_cache_dir() -> Path:
    return sakura_cache_dir("compiled")


@dataclass(frozen=True)
class ArtifactKey:
    """What a compiled shard graph depends on."""

    weights_sha256: str
    architecture: str          # sha256 of the model config (attention mode, RoPE, ...)
    geometry: ShardGeometry
    blocks: tuple[int, ...]
    backend: str
    backend_version: str

    def digest(self) -> str:
        doc = {"weights": self.weights_sha256, "arch": self.architecture,
               "geometry": self.geometry.to_dict(), "blocks": list(self.blocks),
               "backend": self.backend, "version": self.backend_version,
               "shard_format": SHARD_FORMAT}
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()

    def folder_name(self) -> str:
        first, last = self.blocks[0], self.blocks[-1]
        return (f"{self.weights_sha256[:12]}-{self.geometry.describe()}-b{first}-{last}-"
                f"{self.digest()[:16]}")


@dataclass
class CacheStats:
    """Counters of one backend instance: compiles vs loads of cached artifacts."""

    compiles: int = 0
    cache_hits: int = 0
    compile_s: list[float] = field(default_factory=list)
    load_s: list[float] = field(default_factory=list)


class ArtifactCache:
    """Folder of compiled artifacts, one sub-folder per key, published by atomic rename."""

    def __init__(self, root: Path, backend: str) -> None:
        self.root = Path(root) / backend

    def path(self, key: ArtifactKey) -> Path:
        return self.root / key.folder_name()

    def lookup(self, key: ArtifactKey) -> Path | None:
        folder = self.path(key)
        meta = folder / "key.json"
        try:
            doc = json.loads(meta.read_text())
        except (OSError, ValueError):
            return None
        return folder if doc.get("digest") == key.digest() else None

    def publish(self, key: ArtifactKey, build) -> Path:
        """Run ``build(tmp_folder)`` and move the folder into place (first writer wins)."""

        def fill(tmp: Path) -> None:
            build(tmp)
            (tmp / "key.json").write_text(json.dumps(
                {"digest": key.digest(), "weights_sha256": key.weights_sha256,
                 "geometry": key.geometry.to_dict(), "blocks": list(key.blocks),
                 "backend": key.backend, "backend_version": key.backend_version,
                 "shard_format": SHARD_FORMAT}, indent=1))

        return publish_folder(self.path(key), fill,
                              current=lambda _: self.lookup(key) is not None)


class CompiledShard(ABC):
    """One shard graph ready to run: ``run(*inputs) -> (txt, img)``."""

    def __init__(self, blocks: tuple[int, ...], shapes: list[tuple[int, ...]]) -> None:
        self.blocks = blocks
        self.shapes = shapes

    def run(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if len(inputs) != len(self.shapes):
            raise GeometryMismatch(f"shard {self.blocks}: {len(inputs)} inputs, the graph "
                                   f"takes {len(self.shapes)}")
        for i, (x, want) in enumerate(zip(inputs, self.shapes)):
            if tuple(x.shape) != want:
                raise GeometryMismatch(
                    f"shard blocks {self.blocks[0]}-{self.blocks[-1]}: input {i} has shape "
                    f"{tuple(x.shape)}, the graph was compiled for {want} (another template "
                    "geometry needs its own compiled graph)")
        return self._run([x.detach().float().contiguous() for x in inputs])

    @abstractmethod
    def _run(self, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        ...


@dataclass
class BackendConfig:
    """Where compiled artifacts live and backend-specific options."""

    cache_dir: Path = field(default_factory=default_cache_dir)
    options: dict[str, Any] = field(default_factory=dict)


class ExecutionBackend(ABC):
    """Compiles and runs shard graphs (one instance per device process)."""

    name: ClassVar[str]
    compiles: ClassVar[bool] = True  # False: nothing is written to the artifact cache
    explicit_rms: ClassVar[bool] = False  # see edge.backends.shard_ops._explicit_rms_norm
    sigmoid_gelu: ClassVar[bool] = False  # see edge.backends.shard_ops._sigmoid_gelu
    delegable: ClassVar[bool] = False  # see edge.backends.shard (XNNPACK-lowerable ops)

    def __init__(self, config: BackendConfig | None = None) -> None:
        self.config = config or BackendConfig()
        self.stats = CacheStats()
        self.cache = ArtifactCache(self.config.cache_dir, self.name)

    @abstractmethod
    def check_available(self) -> None:
        """Raise :class:`BackendUnavailable` with what to install when it cannot run here."""

    @abstractmethod
    def version(self) -> str:
        """Everything the compiled artifacts depend on besides the model and geometry."""

    @abstractmethod
    def _compile(self, module: ShardModule, example: tuple[torch.Tensor, ...],
                 folder: Path) -> None:
        """Write the compiled artifact of ``module`` into ``folder``."""

    @abstractmethod
    def _load(self, folder: Path, module: ShardModule) -> CompiledShard:
        """Load a compiled artifact written by :meth:`_compile`."""

    def key(self, model: MMDiT, weights: str, blocks: tuple[int, ...],
            geometry: ShardGeometry) -> ArtifactKey:
        arch = hashlib.sha256(json.dumps(model.cfg.to_dict(), sort_keys=True).encode())
        return ArtifactKey(weights, arch.hexdigest(), geometry, tuple(blocks), self.name,
                           self.version())

    def prepare(self, model: MMDiT, blocks: tuple[int, ...], geometry: ShardGeometry,
                weights: str | None = None) -> CompiledShard:
        """The compiled shard: loaded from the cache, else compiled, cached and loaded."""
        import time

        self.check_available()
        module = ShardModule(model, tuple(blocks), geometry, self.explicit_rms,
                             self.sigmoid_gelu, delegable=self.delegable).eval()
        if not self.compiles:
            return self._load(Path(), module)
        key = self.key(model, weights or weights_sha256(model), tuple(blocks), geometry)
        folder = self.cache.lookup(key)
        if folder is None:
            t0 = time.perf_counter()
            try:
                folder = self.cache.publish(
                    key, lambda tmp: self._compile(module, example_inputs(model, blocks,
                                                                          geometry), tmp))
            except BackendError:
                raise
            except Exception as exc:  # noqa: BLE001 - exporter/compiler internals
                raise BackendError(f"{self.name}: compiling shard blocks {blocks[0]}-"
                                   f"{blocks[-1]} ({geometry.describe()}) failed: "
                                   f"{type(exc).__name__}: {exc}") from exc
            self.stats.compiles += 1
            self.stats.compile_s.append(time.perf_counter() - t0)
        else:
            self.stats.cache_hits += 1
        t0 = time.perf_counter()
        try:
            compiled = self._load(folder, module)
        except BackendError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise BackendError(f"{self.name}: loading {folder} failed: "
                               f"{type(exc).__name__}: {exc} (delete the folder to "
                               "recompile)") from exc
        self.stats.load_s.append(time.perf_counter() - t0)
        return compiled

