# bench_adamw: the multi-tensor AdamW step (fp32 master params and moments,
# with and without the bf16 model copy) and the global gradient norm on the
# parameter shapes of Qwen3-0.6B, in GB/s and as a fraction of a
# device-to-device copy; PyTorch baseline (AdamW fused=True) in
# bench/torch_adamw.py.
add_executable(bench_adamw bench_adamw.cu)
target_link_libraries(bench_adamw PRIVATE ${SLIME_LIB} benchmark::benchmark)
target_compile_options(bench_adamw PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra>)
