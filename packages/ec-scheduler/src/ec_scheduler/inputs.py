"""Whether a multimodal item carries what its encoder needs.

On an EC consumer vLLM accepts pre-computed-embedding inputs without the
embedding (`allow_missing_mm_embeddings`): such an item carries only the
fields that size its placeholder (the data parser's metadata fields, e.g.
`audio_num_tokens`), and only the connector can supply its encoder output.
Scheduled for the encoder, it fails in the model runner, and with it the
engine.

Guarantees: an item counts as carrying input when any field other than its
modality's metadata fields holds data; a modality whose metadata fields cannot
be determined has none, so its items with any data keep counting as carrying
input (vLLM's behaviour before this check). Each modality is resolved once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ec_core._vllm import get_logger

if TYPE_CHECKING:
    from vllm.config import ModelConfig
    from vllm.multimodal.inputs import MultiModalFeatureSpec

logger = get_logger(__name__)


class ItemInputs:
    """Tells an item that carries its input from one that carries only metadata."""

    def __init__(self, model_config: ModelConfig | None) -> None:
        self._model_config = model_config
        self._metadata: dict[str, frozenset[str]] = {}
        self.plain: set[str] = set()
        """Modalities known to have no metadata-only field: an item of one carries its
        input iff it has any data (the hot path tests this inline)."""

    def carries_input(self, feature: MultiModalFeatureSpec) -> bool:
        """True if the encoder could run on `feature` (it holds more than metadata)."""
        data = feature.data
        if data is None:
            return False
        fields = getattr(data, "data", data)  # the dict under vLLM's UserDict: faster
        if not fields:
            return False
        metadata = self._metadata.get(feature.modality)
        if metadata is None:
            metadata = self._metadata_fields(feature.modality)
        if not metadata:
            return True  # no field of this modality is metadata alone: any data is input
        return any(elem.data is not None for name, elem in fields.items() if name not in metadata)

    def _metadata_fields(self, modality: str) -> frozenset[str]:
        fields = self._metadata.get(modality)
        if fields is None:
            fields = self._metadata[modality] = self._resolve(modality)
            if not fields:
                self.plain.add(modality)
        return fields

    def _resolve(self, modality: str) -> frozenset[str]:
        if self._model_config is None:
            return frozenset()
        try:
            from vllm.multimodal import MULTIMODAL_REGISTRY

            info = MULTIMODAL_REGISTRY.create_processor(self._model_config).info
            return frozenset(info.data_parser.placeholder_metadata_fields(modality))
        except Exception as exc:  # a model vLLM cannot build a processor for here
            logger.warning(
                "EC CPU tier: could not tell which %s fields are metadata only (%s: %s); "
                "its items with any data are taken to carry their input",
                modality,
                type(exc).__name__,
                exc,
            )
            return frozenset()
