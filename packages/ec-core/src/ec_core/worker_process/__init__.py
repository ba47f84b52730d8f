"""Code that runs in worker processes only: the common worker and the device-independent
parts of the backends."""
