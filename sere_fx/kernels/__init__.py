"""Device kernels. Each module exposes ``AVAILABLE`` and degrades to the PyTorch path without its toolchain."""
