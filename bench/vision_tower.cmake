# bench_vision_tower: the Qwen3-VL vision tower end to end
# (nn::Qwen3VLVisionModel at Qwen3-VL-2B's shape, bf16, one GPU), forward and
# forward + backward on 1, 4, 8 images of 448² and 1, 4 images of 1024²
# (vision_tower/<images>x<side>/{fwd,fwd_bwd}); PyTorch baseline:
# transformers' Qwen3VLVisionModel (SDPA) in bench/torch_vision_tower.py.
add_executable(bench_vision_tower bench_vision_tower.cpp)
target_link_libraries(bench_vision_tower PRIVATE ${SLIME_LIB} benchmark::benchmark)
target_compile_options(bench_vision_tower PRIVATE -Wall -Wextra)
