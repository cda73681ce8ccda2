# bench_attention: packed causal attention (FlashAttention-style mma.sync
# kernels, bf16) forward, backward and both, head_dim 128 and 64; the PyTorch
# baseline (SDPA, FLASH and cuDNN backends) is bench/torch_attention.py.
add_executable(bench_attention bench_attention.cu)
target_link_libraries(bench_attention PRIVATE ${SLIME_LIB} benchmark::benchmark)
target_compile_options(bench_attention PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra>)
