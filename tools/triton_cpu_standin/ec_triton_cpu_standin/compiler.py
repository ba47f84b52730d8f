"""The stand-in's compiler: it supports no target, so nothing is ever compiled."""

from __future__ import annotations

from typing import Any

from triton.backends.compiler import BaseBackend


class StandInCpuBackend(BaseBackend):
    """Refuses every target: kernels must run in Triton's interpreter."""

    @staticmethod
    def supports_target(target: Any) -> bool:
        return False

    def hash(self) -> str:
        return "ec-triton-cpu-standin"

    def parse_options(self, options: dict[str, Any]) -> object:
        raise NotImplementedError("the stand-in cpu backend compiles nothing")

    def add_stages(self, stages: dict[str, Any], options: object, language: Any) -> None:
        raise NotImplementedError("the stand-in cpu backend compiles nothing")

    def load_dialects(self, context: Any) -> None:
        raise NotImplementedError("the stand-in cpu backend compiles nothing")

    def get_module_map(self) -> dict[str, Any]:
        raise NotImplementedError("the stand-in cpu backend compiles nothing")
