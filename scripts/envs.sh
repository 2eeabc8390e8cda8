# Per-engine virtual environments, cached under $SPECPLUG_CACHE keyed by a hash of
# their install recipe, so a rerun reuses them and a clean machine builds them.
# Usage: source scripts/envs.sh; venv=$(ensure_env core|vllm|sglang)
# specplug goes into each env from the wheel built from this checkout (SPECPLUG_INSTALL,
# see install_specplug), reinstalled whenever the checkout's package files change.
# Recipes: requirements/NAME.sh (a script given the venv path) or requirements/NAME.txt.

SPECPLUG_CACHE=${SPECPLUG_CACHE:-$HOME/.cache/specplug}
_SPECPLUG_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

env_hash() {  # hash of everything that decides what env NAME contains
    local name=$1
    (cd "$_SPECPLUG_ROOT" && cat requirements/"$name".* requirements/core.txt && python3 --version) \
        | sha256sum | cut -c1-12
}

_quiet_pip() {  # drop pip's noise about this machine's local package mirrors
    grep -v -e "is ignored: it is neither" -e "^ *\*\*\*" || true
}

_WHEEL_SOURCES="plugins heads pyproject.toml setup.py README.md"  # everything the wheel is built from

source_hash() {  # hash of everything that goes into the wheel
    (cd "$_SPECPLUG_ROOT" && find $_WHEEL_SOURCES -type f \
        ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 | sort -z | xargs -0 sha256sum) \
        | sha256sum | cut -c1-12
}

build_wheel() {  # prints the path of specplug's wheel built from this checkout (cached by source hash)
    local python=$1 out
    out="$SPECPLUG_CACHE/wheels/$(source_hash)"
    mkdir -p "$SPECPLUG_CACHE/wheels"
    (
        flock 8  # the suites' envs are built side by side: one build per source hash
        ls "$out"/specplug-*.whl >/dev/null 2>&1 && exit 0
        # built from a copy of the package files: an in-tree build/ keeps deleted modules
        local tmp
        tmp=$(mktemp -d "$out.XXXX") && mkdir "$tmp/src" || exit 1
        (cd "$_SPECPLUG_ROOT" && tar cf - --exclude=__pycache__ --exclude='*.pyc' $_WHEEL_SOURCES) \
            | tar xf - -C "$tmp/src"
        "$python" -m pip wheel -q --no-deps --no-build-isolation -w "$tmp" "$tmp/src" 2>&1 \
            | grep -E "^(ERROR|error)" >&2
        ls "$tmp"/specplug-*.whl >/dev/null 2>&1 || { rm -rf "$tmp"; exit 1; }
        rm -rf "$tmp/src" "$out" && mv "$tmp" "$out"
    ) 8>"$SPECPLUG_CACHE/wheels/.lock" || return 1
    ls "$out"/specplug-*.whl
}

install_specplug() {  # installs this checkout's specplug into venv $1, as users install it
    # SPECPLUG_INSTALL=wheel (default): the wheel built from this checkout, non-editable, so
    # the suites prove what `pip install` gives users. SPECPLUG_INSTALL=editable: the
    # checkout itself (pip install -e), for quick edit-and-rerun while developing.
    local dir=$1 mode=${SPECPLUG_INSTALL:-wheel} stamp wheel
    case "$mode" in
        wheel) stamp="wheel $(source_hash)" ;;
        editable) stamp="editable $_SPECPLUG_ROOT $(sha256sum "$_SPECPLUG_ROOT/pyproject.toml" "$_SPECPLUG_ROOT/setup.py" | sha256sum | cut -c1-12)" ;;
        *) echo "SPECPLUG_INSTALL must be wheel or editable, got '$mode'" >&2; return 1 ;;
    esac
    [ "$(cat "$dir/.specplug_install" 2>/dev/null)" = "$stamp" ] && return 0
    if [ "$mode" = wheel ]; then
        wheel=$(build_wheel "$dir/bin/python") || { echo "specplug: the wheel did not build" >&2; return 1; }
        "$dir/bin/pip" uninstall -q -y specplug >/dev/null 2>&1
        "$dir/bin/pip" install -q --no-deps --force-reinstall "$wheel" 2>&1 | grep -E "^(ERROR|error)" >&2
    else
        "$dir/bin/pip" install -q --no-deps --no-build-isolation -e "$_SPECPLUG_ROOT" 2>&1 \
            | grep -E "^(ERROR|error)" >&2
    fi
    (cd / && "$dir/bin/python" -c "import specplug") || return 1
    echo "$stamp" > "$dir/.specplug_install"
}

ensure_env() {  # prints the path of a complete venv for NAME, building it if needed
    local name=$1 dir
    dir="$SPECPLUG_CACHE/venvs/$name-$(env_hash "$name")"
    mkdir -p "$SPECPLUG_CACHE/venvs"
    (
        set -o pipefail
        flock 9
        if [ ! -f "$dir/.complete" ]; then
            echo "specplug: building the '$name' environment in $dir (once; cached)" >&2
            rm -rf "$dir"
            python3 -m venv "$dir"
            "$dir/bin/pip" install -q --upgrade pip "setuptools<81" wheel 2>&1 | _quiet_pip >&2
            if [ -f "$_SPECPLUG_ROOT/requirements/$name.sh" ]; then
                bash "$_SPECPLUG_ROOT/requirements/$name.sh" "$dir" 2>&1 | _quiet_pip >&2
            else
                "$dir/bin/pip" install -q -r "$_SPECPLUG_ROOT/requirements/$name.txt" 2>&1 | _quiet_pip >&2
            fi || exit 1
            touch "$dir/.complete"
        fi
        install_specplug "$dir" || exit 1
    ) 9>"$dir.lock" || return 1
    echo "$dir"
}
