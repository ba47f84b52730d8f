"""The connector vLLM instantiates, in every process it builds one in.

`connector.ECCPUTierConnector` routes vLLM's calls to the scheduler half (in
the scheduler process) or to the platform's backend worker (in each worker
process); `backends` finds the installed backends; `plugin` registers the
connector's names with vLLM; `vllm_patches` holds every wrap of a vLLM method
(what each relies on in vLLM is stated there and tested).
"""
