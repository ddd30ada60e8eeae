# bench-table.awk — turns guest-bench.sh's ROW lines into the side-by-side table.
#   ROW <label> <perftest|ours> <round> bytes=N iters=N (typical=µs p99=µs | bw=MiB/s mr=Mpps)
# A non-positive figure (perftest occasionally prints 0.00 under TCG) counts as no result.
# Columns: medians over the rounds of each program, their ratio, the median over the rounds
# of the per-round ratio ("paired": theirs and ours ran back to back, so slow phases of the
# emulated machine tend to hit both), the spread of those per-round ratios (min–max), and
# how many rounds had both figures. Message-rate labels (`*_mr_*`) show only the rate.
function med(list,   n, a, i, j, t) {
  n = split(list, a, " ")
  for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (a[j] + 0 < a[i] + 0) { t = a[i]; a[i] = a[j]; a[j] = t }
  if (n == 0) return ""
  return (n % 2) ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
}
function lo(list,   n, a, i, m) {
  n = split(list, a, " "); m = ""
  for (i = 1; i <= n; i++) if (m == "" || a[i] + 0 < m + 0) m = a[i]
  return m
}
function hi(list,   n, a, i, m) {
  n = split(list, a, " "); m = ""
  for (i = 1; i <= n; i++) if (m == "" || a[i] + 0 > m + 0) m = a[i]
  return m
}
$1 == "ROW" {
  t = $2; who = $3; r = $4
  for (i = 5; i <= NF; i++) {
    split($i, kv, "=")
    if (kv[1] == "bytes") { b[t] = kv[2]; continue }
    if (kv[1] == "iters") { it[t] = kv[2]; continue }
    if (kv[2] + 0 <= 0) continue
    v[t, who, kv[1]] = v[t, who, kv[1]] " " kv[2]
    per[t, who, kv[1], r] = kv[2]
    rounds[t, r] = 1
  }
  if (!(t in seen)) { seen[t] = 1; order[++n] = t }
}
END {
  print "| test | bytes | iters | metric | perftest | ours | ours/perftest | paired | spread of per-round ratios | rounds |"
  print "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- | ---: |"
  for (k = 1; k <= n; k++) {
    t = order[k]
    if (t ~ /_lat$/) { m[1] = "typical"; m[2] = "p99"; cnt = 2 }
    else if (t ~ /_mr_/) { m[1] = "mr"; cnt = 1 }
    else { m[1] = "bw"; m[2] = "mr"; cnt = 2 }
    for (j = 1; j <= cnt; j++) {
      u = (m[j] == "bw") ? " MiB/s" : (m[j] == "mr" ? " Mpps" : " µs")
      th = med(v[t, "perftest", m[j]]); us = med(v[t, "ours", m[j]])
      r = (th != "" && us != "") ? sprintf("%.3f", us / th) : "n/a"
      pl = ""
      for (key in rounds) {
        split(key, kk, SUBSEP)
        if (kk[1] != t) continue
        a = per[t, "perftest", m[j], kk[2]]; o = per[t, "ours", m[j], kk[2]]
        if (a != "" && o != "") pl = pl " " (o / a)
      }
      p = med(pl)
      nr = split(pl, dummy, " ")
      sp = (p == "") ? "n/a" : sprintf("%.3f–%.3f", lo(pl), hi(pl))
      p = (p == "") ? "n/a" : sprintf("%.3f", p)
      name = (m[j] == "bw") ? "average bandwidth" : (m[j] == "mr" ? "message rate" : (m[j] == "typical" ? "typical latency" : "99th percentile latency"))
      label = t
      sub(/_mr_[0-9]+$/, "_bw", label)
      if (t ~ /_mr_/) { d = t; sub(/.*_mr_/, "", d); name = name " (" d " in flight)" }
      printf "| ib_%s | %s | %s | %s | %s%s | %s%s | %s | %s | %s | %d |\n", label, b[t], it[t], name, th, u, us, u, r, p, sp, nr
    }
  }
}
