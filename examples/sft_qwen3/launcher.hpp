// launcher.hpp (sft_qwen3 example): where this process sits in a torchrun /
// mpirun / srun job (slime::comm::process_info_from_env).
//
// Compiled in launcher.cpp, apart from main.cpp: slime/comm/bootstrap.hpp and
// slime/comm/local_comm.hpp both define comm::detail::format_duration, so one
// translation unit cannot include both (the two definitions are identical, so
// two translation units may). Include bootstrap.hpp directly once the library
// keeps one definition.
#pragma once

#include <string>

namespace sft {

struct LauncherInfo {
  int rank = 0;
  int world_size = 1;
  std::string launcher = "single";  // torchrun, openmpi, slurm or single
};

LauncherInfo launcher_info();

}  // namespace sft
