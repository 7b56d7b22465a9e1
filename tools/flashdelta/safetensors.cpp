// Placeholder until the reader lands.
#include "flashdelta/safetensors.h"
