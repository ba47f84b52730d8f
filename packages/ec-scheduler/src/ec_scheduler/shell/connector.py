"""ECCPUTierConnector: the connector vLLM instantiates, one name on every device.

vLLM builds one connector per process and role. In the scheduler process this
shell holds the scheduler half (`ECCPUScheduler`); in each worker process,
the worker of the backend that serves vLLM's platform (`shell.backends`),
imported only there, so the scheduler process never imports device code.

vLLM's calls, in the order of one engine step, and where each goes:

    scheduler process                         worker processes
    -----------------                         ----------------
    ensure_cache_available(request)
    has_cache_item(mm_hash)
    update_state_after_alloc(request, i)
    build_connector_meta()  ── metadata ──▶   bind_connector_metadata(meta)
                                              start_load_caches(encoder_cache)
                                              (the encoder runs)
                                              save_caches(encoder_cache, mm_hash)
                                              get_finished()
    update_connector_output(output) ◀─ report ─ build_connector_worker_meta()
    get_ec_connector_stats()

What each call guarantees is stated once, on the method of the delegate that
does the work (`ECCPUScheduler`, `ECCPUWorker`). The shell works on vLLM's V1
and V2 model runners.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, ClassVar

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
from ec_core.metadata import ECCPUConnectorMetadata
from ec_core.ratelimit import RateLimitedWarnings
from ec_core.sizes import format_bytes
from ec_core.stats import ECCPUConnectorStats
from ec_scheduler.scheduler import ECCPUScheduler
from ec_scheduler.shell import backends, own_cache, vllm_patches
from ec_scheduler.shell.backends import CONNECTOR_NAME, Backend

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

    from ec_core.frontend_process.prometheus import ECCPUPromMetrics
    from ec_core.worker_process.worker import ECCPUWorker

logger = get_logger(__name__)
_outside_step = RateLimitedWarnings(logger)


class ECCPUTierConnector(ECConnectorBase):
    """Routes each vLLM call to the scheduler half or to the backend's worker.

    The backend is resolved when the connector is built, in both roles, so a
    host whose platform has no installed backend fails at start-up with an
    error naming the package to install. `worker_class` (`"module:Class"`)
    replaces the platform's worker, for tests and custom workers; the
    construction seams `_make_scheduler` and `_make_worker` can be overridden.
    """

    worker_class: ClassVar[str | None] = None

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config, role)
        self._scheduler: ECCPUScheduler | None = None
        self._worker: ECCPUWorker | None = None
        self._seen_cache: object = None
        self.worker_path = self.worker_class or self._platform_backend(vllm_config).worker
        if role == ECConnectorRole.SCHEDULER:
            self._scheduler = self._make_scheduler(vllm_config)
            self._log_startup(vllm_config, self._scheduler)
            # vLLM's encoder-cache reset reaches the region (`reset_encoder_outputs`), and
            # vLLM's encoder cache is seen (`see_vllm_encoder_cache`).
            vllm_patches.install_scheduler_hooks()
        elif role == ECConnectorRole.WORKER:
            self._worker = self._make_worker(vllm_config)
        else:
            raise ValueError(f"unknown EC connector role {role!r}")

    # ------------------------------------------------------- construction

    @staticmethod
    def _platform_backend(vllm_config: VllmConfig) -> Backend:
        device_type = backends.current_device_type()
        backend = backends.backend_for(device_type)
        ec_config = vllm_config.ec_transfer_config
        named = backends.backend_named(ec_config.ec_connector if ec_config is not None else None)
        if named is not None and named.device_type != device_type:
            logger.warning(
                "EC CPU tier: %s names the %s backend, but vLLM's platform here is %r: "
                "using %s (%s). %s works on every device.",
                named.alias,
                named.device_type,
                device_type,
                backend.worker_name,
                backend.distribution,
                CONNECTOR_NAME,
            )
        return backend

    def _make_scheduler(self, vllm_config: VllmConfig) -> ECCPUScheduler:
        return ECCPUScheduler(vllm_config, follow_reservation=True)

    def _make_worker(self, vllm_config: VllmConfig) -> ECCPUWorker:
        """Import and build the worker (worker processes only)."""
        from ec_core.worker_process.worker import ECCPUWorker

        cls = backends.load_worker_class(self.worker_path)
        if not issubclass(cls, ECCPUWorker):
            raise TypeError(f"{self.worker_path} is not an ECCPUWorker")
        worker: ECCPUWorker = cls(vllm_config)
        return worker

    def _log_startup(self, vllm_config: VllmConfig, scheduler: ECCPUScheduler) -> None:
        ec_config = vllm_config.ec_transfer_config
        layout = scheduler.layout
        logger.info(
            "EC CPU tier: connector=%s role=%s backend=%s policy=%s region=%s size=%s "
            "blocks=%d block_bytes=%d",
            ec_config.ec_connector if ec_config is not None else CONNECTOR_NAME,
            ec_config.ec_role if ec_config is not None else None,
            self.worker_path.rpartition(":")[2],
            layout.settings.policy,
            layout.path,
            format_bytes(layout.nbytes),
            layout.num_blocks,
            layout.block_size_bytes,
        )

    @property
    def scheduler(self) -> ECCPUScheduler:
        if self._scheduler is None:
            raise RuntimeError(f"{type(self).__name__} was built for the {self.role.name} role")
        return self._scheduler

    @property
    def worker(self) -> ECCPUWorker:
        if self._worker is None:
            raise RuntimeError(f"{type(self).__name__} was built for the {self.role.name} role")
        return self._worker

    # ------------------------------------------------------ worker side

    def _step_metadata(self) -> ECCPUConnectorMetadata | None:
        """The metadata of the step vLLM runs; None, with a rate-limited warning, when
        it calls outside a step (nothing bound): that call is skipped, never raised."""
        meta = self._connector_metadata
        if meta is None:
            _outside_step.warn(
                "unbound",
                "EC CPU tier: vLLM called the connector outside an engine step (no "
                "metadata bound): nothing is saved or loaded for that call",
            )
            return None
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
        meta = self._step_metadata()
        if meta is not None:
            self.worker.start_load_caches(encoder_cache, meta)

    def save_caches(
        self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any
    ) -> None:
        meta = self._step_metadata()
        if meta is not None:
            self.worker.save_caches(encoder_cache, mm_hash, meta)

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

    def take_unavailable_requests(self) -> set[str]:
        if self._scheduler is None:
            return set()
        return self._scheduler.take_unavailable_requests()

    def see_vllm_encoder_cache(self, manager: Any) -> None:
        """vLLM's encoder cache manager (called through `shell.vllm_patches` for each
        request vLLM takes): items it holds are not unavailable, with or without input."""
        scheduler = self._scheduler
        if scheduler is None or self._seen_cache is manager:
            return
        if own_cache.readable(manager):
            self._seen_cache = manager
            scheduler.vllm_holds = functools.partial(own_cache.keeps, manager)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: ECConnectorOutput) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_push_work()

    def reset_encoder_outputs(self) -> None:
        """vLLM reset its encoder cache (the model's weights changed): the region's
        entries are forgotten too (`ECCPUScheduler.invalidate`; called through
        `shell.vllm_patches`, vLLM has no connector hook for it)."""
        if self._scheduler is not None:
            self._scheduler.invalidate()

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
        from ec_core.frontend_process.prometheus import ECCPUPromMetrics

        return ECCPUPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---------------------------------------------------------- common

    def shutdown(self) -> None:
        """Shut the delegate down; safe to call more than once."""
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()
