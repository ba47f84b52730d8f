"""Test and demo helpers shared across the workspace (not a published package).

`tiny_blip2` builds a random-weight BLIP-2 with an in-process tokenizer, fully
offline; `configs` turns such a model folder into real vLLM configs.
"""
