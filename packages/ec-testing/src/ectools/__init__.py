"""Test, demo and device-check tooling of the workspace: the private package ec-testing.

Never published, and imported by no product package (an import contract).
`tiny_blip2`, `tiny_qwen2_5_vl`, `tiny_qwen3_vl`, `tiny_gemma3` and
`tiny_qwen2audio` build random-weight models with in-process tokenizers, fully
offline (`model_build` holds what they share; `families` names them and their
workloads); `configs` turns such a model folder into real vLLM configs;
`engine` runs a real vLLM CPU engine on V1 or V2 (`runners`). `gpu_checks`
and `npu_checks` are the streamed backends' device checks (`device_checks`);
`import_graph` is the static import graph the import contracts are checked on.
"""
