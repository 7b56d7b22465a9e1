#!/usr/bin/env bash
# Installs what FlashDelta needs on a fresh Debian/Ubuntu machine (root or sudo).
# The CUDA toolkit is optional and not installed here.
set -euo pipefail
packages=(cmake g++ make libhwy-dev nlohmann-json3-dev libcli11-dev libgtest-dev libgmock-dev
          clang libclang-rt-dev libomp-dev python3 python3-dev python3-venv python3-pip)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
