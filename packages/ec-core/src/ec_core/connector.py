"""The role-routed connector shell that vLLM instantiates.

vLLM builds one connector per process and role. The shell builds exactly one
delegate — the scheduler half in the scheduler process, the backend's worker
in each worker process — and forwards vLLM's calls to it. The delegates are
built through two construction seams, `_make_scheduler` and `_make_worker`;
the worker class is named by a string and imported only in the worker role,
so the scheduler process never imports device code. (ec-core cannot import
the scheduler package; `ec_scheduler.connector` fills `_make_scheduler`.)

It works on vLLM's V1 model runner and does not refuse V2.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from ec_core import _vllm  # noqa: F401  (version gate before the vLLM import)

# isort: split

from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
    ECConnectorWorkerMetadata,
)

from ec_core._vllm import get_logger
from ec_core.layout import RegionLayout
from ec_core.metadata import ECCPUConnectorMetadata
from ec_core.sizes import format_bytes
from ec_core.stats import ECCPUConnectorStats, ECCPUPromMetrics
from ec_core.worker import ECCPUWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

logger = get_logger(__name__)


class SchedulerHalf(Protocol):
    """What the shell needs from a scheduler half (ec_scheduler.ECCPUScheduler)."""

    def has_cache_item(self, identifier: str) -> bool: ...
    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool: ...
    def update_state_after_alloc(self, request: Request, index: int) -> None: ...
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECCPUConnectorMetadata: ...
    def update_connector_output(self, connector_output: ECConnectorOutput) -> None: ...
    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]: ...
    def has_pending_push_work(self) -> bool: ...
    def get_ec_connector_stats(self) -> ECCPUConnectorStats | None: ...
    def shutdown(self) -> None: ...

    @property
    def layout(self) -> RegionLayout: ...


def import_class(path: str) -> type[Any]:
    """Import `"package.module:ClassName"` and return the class."""
    module_name, _, class_name = path.partition(":")
    if not module_name or not class_name:
        raise ValueError(f"expected 'module:Class', got {path!r}")
    return getattr(importlib.import_module(module_name), class_name)  # type: ignore[no-any-return]


class ECCPUConnectorBase(ECConnectorBase):
    """Routes each vLLM call to the scheduler half or to the worker.

    Subclasses set `worker_class` to `"module:Class"` of their ECCPUWorker
    subclass and provide `_make_scheduler`.
    """

    worker_class: ClassVar[str] = ""

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config, role)
        self._scheduler: SchedulerHalf | None = None
        self._worker: ECCPUWorker | None = None
        if role == ECConnectorRole.SCHEDULER:
            self._scheduler = self._make_scheduler(vllm_config)
            self._log_startup(vllm_config, self._scheduler.layout)
        elif role == ECConnectorRole.WORKER:
            self._worker = self._make_worker(vllm_config)
        else:
            raise ValueError(f"unknown EC connector role {role!r}")

    # ------------------------------------------------------- construction

    def _log_startup(self, vllm_config: VllmConfig, layout: RegionLayout) -> None:
        ec_config = vllm_config.ec_transfer_config
        logger.info(
            "EC CPU tier: connector=%s role=%s backend=%s policy=%s region=%s size=%s "
            "blocks=%d block_bytes=%d",
            type(self).__name__,
            ec_config.ec_role if ec_config is not None else None,
            self.worker_class.rpartition(":")[2] or "?",
            layout.settings.policy,
            layout.path,
            format_bytes(layout.nbytes),
            layout.num_blocks,
            layout.block_size_bytes,
        )

    def _make_scheduler(self, vllm_config: VllmConfig) -> SchedulerHalf:
        """Build the scheduler half (overridden by ec_scheduler's connector)."""
        raise NotImplementedError(f"{type(self).__name__} has no scheduler half")

    def _make_worker(self, vllm_config: VllmConfig) -> ECCPUWorker:
        """Import and build this backend's worker (worker processes only)."""
        if not self.worker_class:
            raise NotImplementedError(f"{type(self).__name__} names no worker_class")
        cls = import_class(self.worker_class)
        if not issubclass(cls, ECCPUWorker):
            raise TypeError(f"{self.worker_class} is not an ECCPUWorker")
        worker: ECCPUWorker = cls(vllm_config)
        return worker

    @property
    def scheduler(self) -> SchedulerHalf:
        if self._scheduler is None:
            raise RuntimeError(f"{type(self).__name__} was built for the {self.role.name} role")
        return self._scheduler

    @property
    def worker(self) -> ECCPUWorker:
        if self._worker is None:
            raise RuntimeError(f"{type(self).__name__} was built for the {self.role.name} role")
        return self._worker

    # ------------------------------------------------------ worker side

    def _step_metadata(self) -> ECCPUConnectorMetadata:
        meta = self._get_connector_metadata()
        if not isinstance(meta, ECCPUConnectorMetadata):
            raise TypeError(
                f"{type(self).__name__} expected ECCPUConnectorMetadata, got {type(meta).__name__}"
            )
        return meta

    def bind_connector_metadata(self, connector_metadata: ECConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, ECCPUConnectorMetadata):
            self._worker.bind(connector_metadata)

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        self.worker.start_load_caches(encoder_cache, self._step_metadata())

    def save_caches(
        self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any
    ) -> None:
        self.worker.save_caches(encoder_cache, mm_hash, self._step_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self.worker.get_finished()
        return None, None

    def build_connector_worker_meta(self) -> ECConnectorWorkerMetadata | None:
        return self.worker.build_connector_worker_meta()

    # --------------------------------------------------- scheduler side

    def has_cache_item(self, identifier: str) -> bool:
        return self.scheduler.has_cache_item(identifier)

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        return self.scheduler.ensure_cache_available(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        self.scheduler.update_state_after_alloc(request, index)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: ECConnectorOutput) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_push_work()

    # ---------------------------------------------------------- stats

    def get_ec_connector_stats(self) -> ECCPUConnectorStats | None:
        """The scheduler half's stats; workers' figures arrive in their reports."""
        if self._scheduler is None:
            return None
        return self._scheduler.get_ec_connector_stats()

    @classmethod
    def build_ec_connector_stats(cls, data: dict[str, Any] | None = None) -> ECCPUConnectorStats:
        return ECCPUConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> ECCPUPromMetrics:
        return ECCPUPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---------------------------------------------------------- common

    def shutdown(self) -> None:
        """Shut the delegate down; safe to call more than once."""
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()
