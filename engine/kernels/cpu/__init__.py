"""PrefixGate's C++ CPU kernels, their build, and the Python wrappers that call them."""
