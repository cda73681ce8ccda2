# bench_grouped_gemm: the grouped GEMM over experts (forward, dgrad, wgrad) on
# Qwen3-30B-A3B-like MoE shapes, every tile configuration; PyTorch baseline
# (torch._grouped_mm) in bench/torch_grouped_gemm.py.
add_executable(bench_grouped_gemm bench_grouped_gemm.cu)
target_link_libraries(bench_grouped_gemm PRIVATE ${SLIME_LIB} benchmark::benchmark)
target_compile_options(bench_grouped_gemm PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra>)
