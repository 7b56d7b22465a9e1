// Placeholder until its owner lands it.
#include <gtest/gtest.h>
