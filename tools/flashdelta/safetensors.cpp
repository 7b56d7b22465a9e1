// TEMPORARY scaffold, replaced by the safetensors reader and writer.
