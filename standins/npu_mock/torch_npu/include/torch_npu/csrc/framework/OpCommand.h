// Declarations of the torch_npu 2.14 OpCommand API the twinkle_mem glue uses, for the build check.
#pragma once
#include <functional>
#include <string>

namespace at_npu {
namespace native {
class OpCommand {
 public:
  OpCommand();
  ~OpCommand();
  OpCommand& Name(const std::string& name);
  OpCommand& SetCustomHandler(std::function<int()> func);
  void Run();
};
}  // namespace native
}  // namespace at_npu
