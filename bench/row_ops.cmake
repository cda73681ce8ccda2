# bench_row_ops: the Qwen3-VL vision tower's row ops (bias_add_, bias_backward
# at 16384 x 4096 and 16384 x 1152, pos_embed_interpolate forward and
# forward + backward at 16384 patches from a 2304 x 1024 table), bf16, in GB/s
# and as a fraction of a device-to-device copy of the same traffic; PyTorch
# baseline in bench/torch_row_ops.py.
add_executable(bench_row_ops bench_row_ops.cu)
target_link_libraries(bench_row_ops PRIVATE ${SLIME_LIB} benchmark::benchmark)
target_compile_options(bench_row_ops PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra>)
