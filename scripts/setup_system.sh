#!/usr/bin/env bash
# System packages that MLX and Qt need on Debian/Ubuntu Linux (OpenBLAS for MLX's CPU matmul,
# Xvfb and xcb libraries for screenshots). Skipped where they are present or apt is absent.
set -euo pipefail
[ "$(uname -s)" = "Linux" ] || exit 0
command -v apt-get >/dev/null || { echo "setup_system: no apt-get; install OpenBLAS and Xvfb yourself" >&2; exit 0; }
pkgs=(libopenblas0-pthread xvfb libxcb-icccm4 libxcb-keysyms1 libxcb-image0 libxcb-render-util0
      libxcb-xinerama0 libxcb-xkb1 libxkbcommon-x11-0 libxcb-cursor0 libegl1 libgl1 libfontconfig1 libdbus-1-3)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
[ ${#missing[@]} -eq 0 ] && exit 0
sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "setup_system: installing ${missing[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
