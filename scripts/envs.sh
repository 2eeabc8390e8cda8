# Per-engine virtual environments, cached under $SPECPLUG_CACHE keyed by a hash of
# their install recipe, so a rerun reuses them and a clean machine builds them.
# Usage: source scripts/envs.sh; venv=$(ensure_env core|vllm|sglang)
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
        # specplug itself is installed editable from this checkout (seconds, once per
        # checkout and pyproject.toml), so a cached env always runs the code in front of it.
        local stamp
        stamp="$_SPECPLUG_ROOT $(sha256sum "$_SPECPLUG_ROOT/pyproject.toml" | cut -c1-12)"
        if [ "$(cat "$dir/.specplug_root" 2>/dev/null)" != "$stamp" ]; then
            "$dir/bin/pip" install -q --no-deps --no-build-isolation -e "$_SPECPLUG_ROOT" 2>&1 \
                | grep -E "^(ERROR|error)" >&2
            "$dir/bin/python" -c "import specplug" || exit 1
            echo "$stamp" > "$dir/.specplug_root"
        fi
    ) 9>"$dir.lock" || return 1
    echo "$dir"
}
