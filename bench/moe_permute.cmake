# bench_moe_permute: the MoE token layout ops (router forward, moe_build_layout,
# permute / unpermute forward and backward), bf16, T = 32768 / E = 128 / k = 8
# and T = 16384 / E = 64 / k = 8, hidden 2048, in GB/s and as a fraction of a
# device-to-device copy of the same traffic; PyTorch baseline in
# bench/torch_moe_permute.py.
add_executable(bench_moe_permute bench_moe_permute.cu)
target_link_libraries(bench_moe_permute PRIVATE ${SLIME_LIB} benchmark::benchmark)
target_compile_options(bench_moe_permute PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra>)
