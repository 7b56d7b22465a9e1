// An environment variable set (or unset, value nullptr) for one scope and restored after:
// how tests run the kernels' forms that environment variables select; and the checks that a
// setting's unknown value is refused and that a two-valued one reads as documented.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <initializer_list>
#include <optional>
#include <string>

#include "flashdelta/types.h"

namespace flashdelta::testing {

class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    value ? setenv(name, value, 1) : unsetenv(name);
  }
  ~ScopedEnv() { old_ ? setenv(name_, old_->c_str(), 1) : unsetenv(name_); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

// Under the environment variable `name` set to `value`, `call` throws
// Error(invalid_argument) naming the variable and the value.
template <class Call>
void expect_setting_rejected(const char* name, const char* value, const Call& call) {
  const ScopedEnv env(name, value);
  try {
    call();
    ADD_FAILURE() << name << ": accepted '" << value << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("'" + std::string(value) + "'"), std::string::npos)
        << e.what();
  }
}

// A two-valued setting read by `get`: false unset, empty, `auto` and `off`; true `on`; each of
// `bad` refused as expect_setting_rejected checks.
template <class Get>
void expect_two_valued_setting(const char* name, const char* off, const char* on,
                               std::initializer_list<const char*> bad, const Get& get) {
  for (const char* value : {static_cast<const char*>(nullptr), "", "auto", off}) {
    const ScopedEnv env(name, value);
    EXPECT_FALSE(get()) << name << "=" << (value ? value : "(unset)");
  }
  {
    const ScopedEnv env(name, on);
    EXPECT_TRUE(get()) << name << "=" << on;
  }
  for (const char* value : bad) expect_setting_rejected(name, value, get);
}

}  // namespace flashdelta::testing
