# bench_policy_loss: the fused RL policy loss (PPO and GSPO with TIS weights,
# k3 KL and entropy; loss, gradients and metrics in one call) on 64 x 4096 and
# 256 x 1024 tokens, time and fraction of copy bandwidth; PyTorch eager
# baseline in bench/torch_policy_loss.py.
add_executable(bench_policy_loss bench_policy_loss.cu)
target_link_libraries(bench_policy_loss PRIVATE ${SLIME_LIB} benchmark::benchmark)
target_compile_options(bench_policy_loss PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra>)
