# bench_linear: Linear's forward, dgrad and wgrad GEMMs (cuBLAS, bf16) on
# Qwen3-like shapes; PyTorch baseline and comparison in bench/torch_linear.py.
add_executable(bench_linear bench_linear.cu)
target_link_libraries(bench_linear PRIVATE ${SLIME_LIB} benchmark::benchmark)
target_compile_options(bench_linear PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra>)
