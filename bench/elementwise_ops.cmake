# bench_elementwise_ops: the memory-bound ops (rms_norm, rope, swiglu, add),
# bf16, T = 16384, in GB/s and as a fraction of a device-to-device copy of the
# same traffic; PyTorch baseline in bench/torch_elementwise_ops.py.
add_executable(bench_elementwise_ops bench_elementwise_ops.cu)
target_link_libraries(bench_elementwise_ops PRIVATE ${SLIME_LIB} benchmark::benchmark)
target_compile_options(bench_elementwise_ops PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra>)
