"""kernels package of pdserve."""
