"""The connector vLLM instantiates, in every process it builds one in.

`connector.ECCPUTierConnector` routes vLLM's calls to the scheduler half (in
the scheduler process) or to the platform's backend worker (in each worker
process); `backends` finds the installed backends; `plugin` registers the
connector's names with vLLM.
"""
