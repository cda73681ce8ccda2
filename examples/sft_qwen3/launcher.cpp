// launcher.cpp (sft_qwen3 example): see launcher.hpp.
#include "launcher.hpp"

#include "slime/comm/bootstrap.hpp"

namespace sft {

LauncherInfo launcher_info() {
  const slime::comm::ProcessInfo p = slime::comm::process_info_from_env();
  return {p.rank, p.world_size, p.launcher};
}

}  // namespace sft
