"""Code that runs in the scheduler process only: the block allocator and its policies."""
