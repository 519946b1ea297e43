// CUDA kernels: in progress
