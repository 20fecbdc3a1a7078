// Classify an `http-cache-tests` results file as cache-tests.fyi does
// (lib/display.mjs determineTestResult, with dependencies honoured), and
// print one line per test and the totals. Used by bin/pier/tests/cache.rs.
//
// usage: node summary.mjs PACKAGE_DIR RESULTS.json
// Exit 0 when every required test passes (or is skipped because a test it
// depends on is not supported), 1 otherwise.
import fs from 'fs'
import path from 'path'
import { pathToFileURL } from 'url'

const [pkg, resultsFile] = process.argv.slice(2)
const load = async f => (await import(pathToFileURL(path.join(pkg, f)).href)).default
const suites = await load('tests/index.mjs')
// In the npm package (0.4.5) only; the repository dropped it since.
if (fs.existsSync(path.join(pkg, 'tests/surrogate-control.mjs'))) {
  suites.push(await load('tests/surrogate-control.mjs'))
}
const results = JSON.parse(fs.readFileSync(resultsFile, 'utf8'))

const byId = {}
for (const s of suites) for (const t of s.tests) byId[t.id] = t
const kindOf = t => (t.kind === undefined ? 'required' : t.kind)

function outcome (id) {
  const t = byId[id]
  const r = results[id]
  if (r === undefined) return 'untested'
  for (const dep of t.depends_on || []) {
    if (!['pass', 'yes'].includes(outcome(dep))) return 'dependency_fail'
  }
  if (Array.isArray(r) && r[0] === 'Setup') return r[1] === 'retry' ? 'retry' : 'setup_fail'
  switch (kindOf(t)) {
    case 'required': return r === true ? 'pass' : 'fail'
    case 'optimal': return r === true ? 'pass' : 'optional_fail'
    default: return r === true ? 'yes' : 'no'
  }
}

const counts = {}
let requiredBad = 0
for (const id of Object.keys(byId).sort()) {
  if (byId[id].browser_only) continue
  const kind = kindOf(byId[id])
  const o = outcome(id)
  counts[kind] = counts[kind] || {}
  counts[kind][o] = (counts[kind][o] || 0) + 1
  const detail = Array.isArray(results[id]) ? ` (${results[id].join(': ')})` : ''
  console.log(`${kind}\t${o}\t${id}${detail}`)
  if (kind === 'required' && !['pass', 'dependency_fail'].includes(o)) requiredBad++
}
for (const [kind, c] of Object.entries(counts)) {
  const total = Object.values(c).reduce((a, b) => a + b, 0)
  console.log(`TOTAL ${kind}: ${total} tests, ` +
    Object.entries(c).map(([k, v]) => `${k}=${v}`).join(', '))
}
console.log(`REQUIRED NOT PASSING: ${requiredBad}`)
process.exit(requiredBad === 0 ? 0 : 1)
