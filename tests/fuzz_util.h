// The verdict of the seeded fuzz tests on one mutated input (config, safetensors file, checkpoint index,
// tokenizer files): accepted, or refused with a clean error.
#pragma once

#include <gtest/gtest.h>

#include <exception>
#include <string>

#include "core/error.h"

namespace k3::test {

// Runs f: true when it returns, false when it throws a k3::Error whose message is one line (and contains
// `names` when given). Any other exception is a test failure (and false).
template <typename F>
bool accepted_or_clean_error(F&& f, const std::string& names = "") {
  try {
    f();
    return true;
  } catch (const k3::Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    if (!names.empty()) EXPECT_NE(msg.find(names), std::string::npos) << msg;
    return false;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not a k3::Error: " << e.what();
    return false;
  }
}

}  // namespace k3::test
