"""Test and demo helpers shared across the workspace (not a published package).

`tiny_blip2`, `tiny_qwen2_5_vl`, `tiny_qwen3_vl`, `tiny_gemma3` and
`tiny_qwen2audio` build random-weight models with in-process tokenizers, fully
offline (`model_build` holds what they share; `families` names them and their
workloads); `configs` turns such a model folder into real vLLM configs;
`engine` runs a real vLLM CPU engine on V1 or V2 (`runners`).
"""
