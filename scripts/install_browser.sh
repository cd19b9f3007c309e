#!/usr/bin/env bash
# `make install`'s browser step. The browser tests (tests/http/test_browser.py) drive Debian's
# Chromium through its WebDriver (chromium-driver): nothing is downloaded from a browser vendor.
# Quiet when both are there; installs them with apt-get when it can (root, Debian or Ubuntu);
# otherwise says exactly what to install, and the browser tests fail saying the same.
set -euo pipefail

# zsh, for the test of `trainwire completion zsh` (tests/unit/test_cli_completion.py).
if ! command -v zsh >/dev/null 2>&1 && [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
  echo "installing zsh (apt-get) for the zsh completion test"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends zsh >/dev/null 2>&1 ||
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      --no-install-recommends zsh >/dev/null; } || echo "apt-get could not install zsh" >&2
fi

have() {
  command -v "${CHROMIUM:-chromium}" >/dev/null 2>&1 &&
    command -v "${CHROMEDRIVER:-chromedriver}" >/dev/null 2>&1
}

have && exit 0
if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
  echo "installing chromium and chromium-driver (apt-get) for the browser tests"
  export DEBIAN_FRONTEND=noninteractive
  if apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium chromium-driver \
    >/dev/null && have; then
    exit 0
  fi
  echo "apt-get could not install chromium and chromium-driver" >&2
fi
cat >&2 <<'MSG'
The browser tests need Chromium and its WebDriver. Install them with
    sudo apt-get install chromium chromium-driver
(Debian, Ubuntu), or set CHROMIUM and CHROMEDRIVER to the browser and its driver.
Until then `make test` fails at tests/http/test_browser.py (TRAINWIRE_BROWSER_TESTS=0 skips them).
MSG
