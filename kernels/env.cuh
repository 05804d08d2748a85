// Environment settings of the kernel library (host side): the two parsing rules its switches use.
// Each caller reads a variable when it needs it and caches the value itself (a function-local
// static, or pdl.cuh's switches that pdl_mode() can override).
#pragma once
#include <stdlib.h>

namespace rwkv_env {

// A switch that defaults to on: off only when the variable is set and starts with '0' ("0", "00",
// "0x"); unset, empty or anything else ("1", "off") is on.
inline bool env_on(const char *name) {
    const char *v = getenv(name);
    return !(v && v[0] == '0');
}

// An integer setting: dflt when the variable is unset or empty, else atoi's value (0 when it does
// not start with a number).
inline int env_int(const char *name, int dflt) {
    const char *env = getenv(name);
    return env && env[0] ? atoi(env) : dflt;
}

}  // namespace rwkv_env
