"""Hot operations, one file per op. Each file holds a plain-torch reference that defines the
op's semantics and signature; Triton kernels with the same signature join them for CUDA
(a later issue), chosen by the dispatcher in each module. This version has the references
only, which is what runs on the CPU and in CI."""
