"""The stand-in's driver: never active, so Triton never launches through it."""

from __future__ import annotations

from typing import Any

from triton.backends.driver import DriverBase


class StandInCpuDriver(DriverBase):
    """Present so that Triton lists a `cpu` backend; every device call is refused."""

    @classmethod
    def is_active(cls) -> bool:
        return False

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise NotImplementedError("the stand-in cpu backend compiles nothing")

    def get_current_target(self) -> Any:
        raise NotImplementedError("the stand-in cpu backend has no target")

    def get_active_torch_device(self) -> Any:
        import torch

        return torch.device("cpu")

    def get_benchmarker(self) -> Any:
        raise NotImplementedError("the stand-in cpu backend runs no benchmark")
