# The batch-invariant numerics mode (ops/batch_invariant.hpp): its switch and
# the CPU's row independence; on the GPU, rows that do not depend on the batch.
slime_add_test(test_ops_batch_invariant LABELS ops SOURCES ops/test_batch_invariant.cpp)
if(SLIME_GPU_TESTS)
  slime_add_test(test_ops_batch_invariant_gpu LABELS ops gpu SOURCES ops/test_batch_invariant_gpu.cu)
endif()
