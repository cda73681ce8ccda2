# bench_vision_ops: the Qwen3-VL vision tower's memory-bound ops (layer_norm,
# gelu tanh / erf), bf16, rows 4096 and 16384 at widths 1024 and 4096,
# forward and forward + backward, in GB/s and as a fraction of a
# device-to-device copy of the same traffic; PyTorch baseline in
# bench/torch_vision_ops.py.
add_executable(bench_vision_ops bench_vision_ops.cu)
target_link_libraries(bench_vision_ops PRIVATE ${SLIME_LIB} benchmark::benchmark)
target_compile_options(bench_vision_ops PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra>)
