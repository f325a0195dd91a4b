"""A strict stand-in for ``qai_hub.Client`` (tests only; no network).

Every method the product calls is bound against the signature of the *real* qai_hub
method (``inspect.signature``), so a call the real client would reject (an unknown or
misspelt keyword, a missing argument) raises ``TypeError`` here too; argument types the
product must get right are checked as well (a real ``qai_hub.Device``, a real
``ClientConfig``, an uploaded path that exists, ``inputs=None`` for profiling). Anything
else the product would call on the client is missing (``AttributeError``). The stub is
installed over ``qai_hub.Client`` with ``monkeypatch``; ``Device`` and ``ClientConfig``
stay the real qai_hub classes.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import qai_hub

REAL_CLIENT = qai_hub.Client
REAL_COMPILE_JOB = qai_hub.CompileJob


def _bind(real: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    bound = inspect.signature(real).bind(*args, **kwargs)
    bound.apply_defaults()
    return {k: v for k, v in bound.arguments.items() if k != "self"}


class StubTargetModel:
    def __init__(self, model_id: str) -> None:
        self.model_id = model_id


class StubJob:
    def __init__(self, hub: StubHub, job_id: str, target: StubTargetModel | None) -> None:
        self.hub, self.job_id, self._target = hub, job_id, target
        self.url = f"https://workbench.aihub.qualcomm.com/jobs/{job_id}/"

    def get_target_model(self, *args: Any, **kwargs: Any) -> StubTargetModel | None:
        self.hub.calls.append(("get_target_model",
                               _bind(REAL_COMPILE_JOB.get_target_model, self, *args, **kwargs)))
        return self._target


class StubHub:
    """Records the calls of the product on the client; ``install`` puts it in qai_hub."""

    def __init__(self, compile_fails: bool = False) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.compile_fails = compile_fails
        self.jobs: dict[str, StubJob] = {}
        self.client_class = self._client_class()

    def install(self, monkeypatch: Any) -> StubHub:
        monkeypatch.setattr(qai_hub, "Client", self.client_class)
        return self

    def kinds(self) -> list[str]:
        return [k for k, _ in self.calls]

    def _client_class(self) -> type:
        hub = self

        class Client:
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                args_ = _bind(REAL_CLIENT.__init__, self, *args, **kwargs)
                config = args_["config"]
                assert config is None or isinstance(config, qai_hub.ClientConfig), config
                hub.calls.append(("Client", args_))

            def submit_compile_job(self, *args: Any, **kwargs: Any) -> StubJob:
                a = _bind(REAL_CLIENT.submit_compile_job, self, *args, **kwargs)
                assert isinstance(a["device"], qai_hub.Device), a["device"]
                assert Path(a["model"]).exists(), a["model"]  # what would be uploaded
                hub.calls.append(("submit_compile_job", a))
                job = StubJob(hub, f"jc{len(hub.jobs) + 1}",
                              None if hub.compile_fails else StubTargetModel("m1"))
                hub.jobs[job.job_id] = job
                return job

            def submit_inference_job(self, *args: Any, **kwargs: Any) -> StubJob:
                a = _bind(REAL_CLIENT.submit_inference_job, self, *args, **kwargs)
                assert isinstance(a["device"], qai_hub.Device), a["device"]
                assert isinstance(a["model"], StubTargetModel), a["model"]
                # qai_hub: inputs=None is allowed only with profile=True
                assert a["inputs"] is not None or a["profile"] is True
                hub.calls.append(("submit_inference_job", a))
                return StubJob(hub, f"jp{len(hub.jobs) + 1}", None)

            def get_job(self, *args: Any, **kwargs: Any) -> StubJob:
                a = _bind(REAL_CLIENT.get_job, self, *args, **kwargs)
                hub.calls.append(("get_job", a))
                if a["job_id"] not in hub.jobs:
                    raise qai_hub.UserError(f"job {a['job_id']} not found")
                return hub.jobs[a["job_id"]]

            def get_model(self, *args: Any, **kwargs: Any) -> StubTargetModel:
                a = _bind(REAL_CLIENT.get_model, self, *args, **kwargs)
                hub.calls.append(("get_model", a))
                return StubTargetModel(a["model_id"])

        return Client
