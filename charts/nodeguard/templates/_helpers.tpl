{{- define "nodeguard.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "nodeguard.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains (include "nodeguard.name" .) .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "nodeguard.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "nodeguard.serviceAccountName" -}}
{{- default (include "nodeguard.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "nodeguard.selectorLabels" -}}
app.kubernetes.io/name: {{ include "nodeguard.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "nodeguard.labels" -}}
{{ include "nodeguard.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The image reference: repository:tag, pinned by digest when image.digest is set. */}}
{{- define "nodeguard.image" -}}
{{- $ref := printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- if .Values.image.digest -}}{{- $ref = printf "%s@%s" $ref .Values.image.digest -}}{{- end -}}
{{- $ref -}}
{{- end -}}

{{/* The spec of the policy the chart installs (defaultPolicy), as JSON; {}
when it installs none. */}}
{{- define "nodeguard.policySpec" -}}
{{- if .Values.defaultPolicy.enabled -}}
{{- $spec := .Values.defaultPolicy.spec -}}
{{- if not $spec -}}
{{- /* The shipped policy reads the journal and writes logind's drop-in
where the chart mounts them (host.journal.path, host.logindDropIn.path). */ -}}
{{- $spec = (.Files.Get "files/default-policy.yaml" | fromYaml).spec -}}
{{- range $m := $spec.monitors -}}
{{- if hasKey $m.source "journald" -}}
{{- $_ := set $m.source.journald "directory" $.Values.host.journal.path -}}
{{- end -}}
{{- end -}}
{{- $_ := set $spec.shutdown "logindDropInDir" .Values.host.logindDropIn.path -}}
{{- end -}}
{{- toJson $spec -}}
{{- else -}}
{}
{{- end -}}
{{- end -}}

{{/* What host access the chart's own policy uses, as JSON: for each of
kmsg, journal, dbus, logindDropIn and watchdog, the list of reasons (empty:
not needed). The defaults are the agent's (src/policy): a kmsg source reads
/dev/kmsg, a shutdown section writes its drop-in to
/etc/systemd/logind.conf.d, a watchdog pets /dev/watchdog. A path the pod's
mount would not serve fails the render, naming both values. */}}
{{- define "nodeguard.policyNeeds" -}}
{{- $spec := include "nodeguard.policySpec" . | fromJson -}}
{{- $h := .Values.host -}}
{{- $n := dict "kmsg" (list) "journal" (list) "dbus" (list) "logindDropIn" (list) "watchdog" (list) -}}
{{- range $m := ($spec.monitors | default list) -}}
{{- $s := $m.source | default dict -}}
{{- if hasKey $s "kmsg" -}}
{{- $path := ($s.kmsg | default dict).path | default "/dev/kmsg" -}}
{{- if ne $path "/dev/kmsg" -}}
{{- fail (printf "defaultPolicy: monitor %s reads kmsg records from %s; the chart mounts only /dev/kmsg (host.kmsg)" $m.name $path) -}}
{{- end -}}
{{- $_ := set $n "kmsg" (append $n.kmsg (printf "monitor %s reads /dev/kmsg" $m.name)) -}}
{{- end -}}
{{- if hasKey $s "file" -}}
{{- $path := ($s.file | default dict).path | default "" -}}
{{- $logs := trimSuffix "/" $h.logs.path -}}
{{- if not (and $h.logs.enabled (hasPrefix (printf "%s/" $logs) $path)) -}}
{{- fail (printf "defaultPolicy: monitor %s reads the file %s, which the pod does not mount: set host.logs.enabled=true with host.logs.path a directory above it (now %s, %s)" $m.name $path $h.logs.path (ternary "on" "off" $h.logs.enabled)) -}}
{{- end -}}
{{- end -}}
{{- if hasKey $s "journald" -}}
{{- $dir := ($s.journald | default dict).directory | default "" -}}
{{- if not $dir -}}
{{- fail (printf "defaultPolicy: monitor %s has no journald directory, so it would read /var/log/journal and /run/log/journal; the pod mounts one directory, host.journal.path (%s): set source.journald.directory to it" $m.name $h.journal.path) -}}
{{- end -}}
{{- if and (ne $dir $h.journal.path) (not (hasPrefix (printf "%s/" (trimSuffix "/" $h.journal.path)) $dir)) -}}
{{- fail (printf "defaultPolicy: monitor %s reads the journal in %s, but the pod mounts host.journal.path (%s): set host.journal.path to %s" $m.name $dir $h.journal.path $dir) -}}
{{- end -}}
{{- $_ := set $n "journal" (append $n.journal (printf "monitor %s reads the journal" $m.name)) -}}
{{- end -}}
{{- if hasKey $s "systemd" -}}
{{- $_ := set $n "dbus" (append $n.dbus (printf "monitor %s asks systemd over D-Bus" $m.name)) -}}
{{- $sd := $s.systemd | default dict -}}
{{- if $sd.repair -}}
{{- if not (include "nodeguard.unitAllowed" (list $sd.unit $.Values.trust.repairUnits)) -}}
{{- fail (printf "defaultPolicy: monitor %s repairs unit %s, which trust.repairUnits does not allow: add it" $m.name $sd.unit) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- range $r := ($m.rules | default list) -}}
{{- if $r.command -}}
{{- include "nodeguard.checkCommand" (list $ (first $r.command) (printf "monitor %s" $m.name)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- range $p := ($spec.probes | default list) -}}
{{- if $p.exec -}}
{{- include "nodeguard.checkCommand" (list $ (first $p.exec.command) (printf "probe %s" $p.name)) -}}
{{- end -}}
{{- if not $.Values.hostNetwork -}}
{{- $target := printf "%s %s %s" (($p.http | default dict).url | default "") (($p.tcp | default dict).host | default "") (($p.grpc | default dict).host | default "") -}}
{{- if or (contains "127.0.0.1" $target) (contains "localhost" $target) -}}
{{- fail (printf "defaultPolicy: probe %s targets the node's loopback, which hostNetwork=false takes away (it would always fail): set hostNetwork=true" $p.name) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if hasKey $spec "shutdown" -}}
{{- $_ := set $n "dbus" (append $n.dbus "shutdown holds logind's delay lock over D-Bus") -}}
{{- $sh := $spec.shutdown | default dict -}}
{{- $windows := int ($sh.gracePeriodSeconds | default 0) -}}
{{- if $sh.gracePeriodByPriority -}}
{{- $windows = 0 -}}
{{- range $g := $sh.gracePeriodByPriority -}}{{- $windows = add $windows (int $g.gracePeriodSeconds) -}}{{- end -}}
{{- end -}}
{{- $delay := add $windows (int (ternary $sh.safetyMarginSeconds 2 (hasKey $sh "safetyMarginSeconds"))) -}}
{{- if gt (int $delay) (int $.Values.trust.maxInhibitDelaySeconds) -}}
{{- fail (printf "defaultPolicy: shutdown needs an inhibit delay of %d s (its windows plus the safety margin), above trust.maxInhibitDelaySeconds (%d): raise it (and terminationGracePeriodSeconds to at least 5 s more)" (int $delay) (int $.Values.trust.maxInhibitDelaySeconds)) -}}
{{- end -}}
{{- $dir := "/etc/systemd/logind.conf.d" -}}
{{- if hasKey ($spec.shutdown | default dict) "logindDropInDir" -}}{{- $dir = $spec.shutdown.logindDropInDir -}}{{- end -}}
{{- if $dir -}}
{{- if ne (trimSuffix "/" $dir) (trimSuffix "/" $h.logindDropIn.path) -}}
{{- fail (printf "defaultPolicy: shutdown.logindDropInDir is %s, but the pod mounts host.logindDropIn.path (%s): set one to the other" $dir $h.logindDropIn.path) -}}
{{- end -}}
{{- $_ := set $n "logindDropIn" (append $n.logindDropIn (printf "shutdown raises logind's InhibitDelayMaxSec with a drop-in in %s" $dir)) -}}
{{- end -}}
{{- end -}}
{{- $wd := $spec.watchdog | default dict -}}
{{- if has ($wd.mode | default "Off") (list "Systemd" "Both") -}}
{{- fail (printf "defaultPolicy: watchdog mode %s pets systemd's watchdog, which a pod has not (that is for the host service): use mode Device" $wd.mode) -}}
{{- end -}}
{{- if eq ($wd.mode | default "Off") "Device" -}}
{{- $dev := $wd.device | default "/dev/watchdog" -}}
{{- if ne $dev $h.watchdog.device -}}
{{- fail (printf "defaultPolicy: watchdog.device is %s, but the pod mounts host.watchdog.device (%s): set one to the other" $dev $h.watchdog.device) -}}
{{- end -}}
{{- $_ := set $n "watchdog" (append $n.watchdog (printf "watchdog pets %s" $dev)) -}}
{{- end -}}
{{- toJson $n -}}
{{- end -}}

{{/* Host access in force, as JSON ({"kmsg": true, ...}). `auto` (the
default) is on exactly when the chart's own policy uses it; true and false
are kept, but false where that policy needs it fails the render. */}}
{{- define "nodeguard.hostAccess" -}}
{{- $needs := include "nodeguard.policyNeeds" . | fromJson -}}
{{- $out := dict -}}
{{- range $k := list "kmsg" "journal" "dbus" "logindDropIn" "watchdog" -}}
{{- $v := index $.Values.host $k "enabled" -}}
{{- $why := index $needs $k -}}
{{- if or (kindIs "invalid" $v) (eq (toString $v) "auto") -}}
{{- $_ := set $out $k (gt (len $why) 0) -}}
{{- else if and (not $v) (gt (len $why) 0) -}}
{{- fail (printf "host.%s.enabled is false, but the chart's defaultPolicy needs it (%s): set host.%s.enabled to auto, or change defaultPolicy.spec" $k (join "; " $why) $k) -}}
{{- else -}}
{{- $_ := set $out $k $v -}}
{{- end -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/* Why the pod needs Pod Security's privileged level, as a list in JSON
(empty: it meets restricted). Baseline already refuses host networking,
hostPath volumes and privileged containers. */}}
{{- define "nodeguard.privilegedBecause" -}}
{{- $a := include "nodeguard.hostAccess" . | fromJson -}}
{{- $h := .Values.host -}}
{{- $why := list -}}
{{- if .Values.hostNetwork -}}{{- $why = append $why "hostNetwork (the node's network, for probes of 127.0.0.1)" -}}{{- end -}}
{{- if $h.stateDir.enabled -}}{{- $why = append $why (printf "host.stateDir (hostPath %s)" $h.stateDir.path) -}}{{- end -}}
{{- if $a.kmsg -}}{{- $why = append $why "host.kmsg (/dev/kmsg, a privileged container)" -}}{{- end -}}
{{- if $a.watchdog -}}{{- $why = append $why (printf "host.watchdog (%s, a privileged container)" $h.watchdog.device) -}}{{- end -}}
{{- if $a.journal -}}{{- $why = append $why (printf "host.journal (hostPath %s)" $h.journal.path) -}}{{- end -}}
{{- if $a.dbus -}}{{- $why = append $why (printf "host.dbus (hostPath %s)" $h.dbus.socket) -}}{{- end -}}
{{- if $a.logindDropIn -}}{{- $why = append $why (printf "host.logindDropIn (hostPath %s)" $h.logindDropIn.path) -}}{{- end -}}
{{- if $h.logs.enabled -}}{{- $why = append $why (printf "host.logs (hostPath %s)" $h.logs.path) -}}{{- end -}}
{{- if $h.plugins.hostRoot -}}{{- $why = append $why "host.plugins.hostRoot (hostPath /, read-only, and hostPID)" -}}
{{- else if $h.plugins.enabled -}}{{- $why = append $why (printf "host.plugins (hostPath %s)" $h.plugins.path) -}}{{- end -}}
{{- toJson $why -}}
{{- end -}}

{{/* Stops an install whose pod the namespace's Pod Security admission would
refuse: the DaemonSet would then show 0 pods, with the reason only in its
Events. Checked against the live namespace (lookup); skipped where there is
no cluster to ask (helm template, a client-side dry run), and with
podSecurity.check=false. A namespace without an enforce label gets the
cluster's default level, which the chart cannot read: it must be labelled. */}}
{{- define "nodeguard.checkPodSecurity" -}}
{{- $why := include "nodeguard.privilegedBecause" . | fromJsonArray -}}
{{- /* dig: an upgrade with --reuse-values from an older release has no podSecurity. */ -}}
{{- if and (dig "check" true (.Values.podSecurity | default dict)) $why (lookup "v1" "Namespace" "" "kube-system") -}}
{{- $ns := .Release.Namespace -}}
{{- $live := lookup "v1" "Namespace" "" $ns -}}
{{- $fix := printf "kubectl label namespace %s pod-security.kubernetes.io/enforce=privileged" $ns -}}
{{- $because := printf "nodeguard's pod needs Pod Security level privileged for %s" (join ", " $why) -}}
{{- if not $live -}}
{{- fail (printf "namespace %s does not exist yet (helm's --create-namespace makes it without Pod Security labels, and where the cluster's default level is baseline or restricted the DaemonSet gets no pods). %s. Create and label it first: kubectl create namespace %s && %s (or set podSecurity.check=false if your cluster admits privileged pods there another way)" $ns $because $ns $fix) -}}
{{- end -}}
{{- $enforce := index ($live.metadata.labels | default dict) "pod-security.kubernetes.io/enforce" | default "" -}}
{{- /* An upgrade where the namespace has no label but already has pods of
this release whose template needed privileged (host network or a hostPath):
baseline and restricted refuse those, so the namespace admits privileged
pods (the cluster's default, or an exemption). Pods that exist were
admitted, Ready or not. */ -}}
{{- $running := 0 -}}
{{- if and (not $enforce) .Release.IsUpgrade -}}
{{- $ds := lookup "apps/v1" "DaemonSet" $ns (include "nodeguard.fullname" .) -}}
{{- if $ds -}}
{{- $tpl := $ds.spec.template.spec -}}
{{- $hostPath := false -}}
{{- range $v := ($tpl.volumes | default list) -}}{{- if $v.hostPath -}}{{- $hostPath = true -}}{{- end -}}{{- end -}}
{{- if or $tpl.hostNetwork $hostPath -}}
{{- $running = int (($ds.status | default dict).currentNumberScheduled | default 0) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and (ne $enforce "privileged") (eq $running 0) -}}
{{- fail (printf "namespace %s has Pod Security enforce level %s; %s. Run: %s (or set podSecurity.check=false if your cluster admits privileged pods there another way)" $ns (ternary (printf "%q" $enforce) "unset (the cluster's default, which the chart cannot read)" (ne $enforce "")) $because $fix) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Stops an install or upgrade where the cluster's NodeGuardPolicy CRD is
older than this chart's or not this release's. Helm installs crds/ on the
first install only (an upgrade, or an install after an uninstall, which
leaves the CRD, keeps the old one), and the API server then drops from a
policy written without strict field validation (Helm's own defaultPolicy,
most controllers) every field the old schema lacks, with only a warning.
The generated CRD carries the SHA-256 of its spec (nodeguard.io/schema-sha256)
and the release it comes from (nodeguard.io/version, the chart's version).
The same digest passes; a CRD of a newer release by semver precedence
passes too (a downgrade, or a canary release of a newer chart applied it:
applying this chart's would take fields away); anything else stops the
render with the command that applies this chart's: an older release's CRD
(a release candidate of this version among them), one of the same version
with another digest (a development build), one without the annotations
(from before them) or whose version is no version, and, on an upgrade, none
at all (helm upgrade never creates it). On a first install the CRD is missing only in a dry run (Helm creates
crds/ before rendering, unless --skip-crds): that passes. Skipped where
there is no cluster to ask (helm template, a client-side dry run; lookup is
empty) and with crd.check=false. */}}
{{- define "nodeguard.checkCrd" -}}
{{- if and (dig "check" true (.Values.crd | default dict)) (lookup "v1" "Namespace" "" "kube-system") -}}
{{- $key := "nodeguard.io/schema-sha256" -}}
{{- $vkey := "nodeguard.io/version" -}}
{{- $mine := (fromYaml (.Files.Get "crds/nodeguard.io_nodeguardpolicies.yaml")).metadata.annotations | default dict -}}
{{- $want := index $mine $key | default "" -}}
{{- $live := lookup "apiextensions.k8s.io/v1" "CustomResourceDefinition" "" "nodeguardpolicies.nodeguard.io" -}}
{{- $fix := printf "Apply this chart's CRD first: helm show crds %s --version %s | kubectl apply --server-side --force-conflicts -f - (the chart from where you install it; or set crd.check=false to keep the installed one)" (include "nodeguard.chartRef" .) .Chart.Version -}}
{{- if and (not $live) .Release.IsUpgrade -}}
{{- fail (printf "the cluster has no NodeGuardPolicy CRD, and helm upgrade never creates one: the agents would find no policies and the chart's defaultPolicy could not be written. %s" $fix) -}}
{{- end -}}
{{- if and $live $want -}}
{{- $ann := $live.metadata.annotations | default dict -}}
{{- $have := index $ann $key | default "" -}}
{{- $haveVersion := index $ann $vkey | default "" -}}
{{- if ne $have $want -}}
{{- /* Newer by semver precedence (a release candidate of a later version is
newer, 0.1.0-rc.1 older than 0.1.0); a value that is no version is not. */ -}}
{{- $newer := false -}}
{{- if regexMatch "^v?[0-9]+\\.[0-9]+\\.[0-9]+(-[0-9A-Za-z.-]+)?(\\+[0-9A-Za-z.-]+)?$" $haveVersion -}}
{{- $newer = eq ((semver $haveVersion).Compare (semver .Chart.Version)) 1 -}}
{{- end -}}
{{- if not $newer -}}
{{- fail (printf "the cluster's NodeGuardPolicy CRD is not this chart's (its %s is %s, from release %s; this chart's %s, release %s), and Helm never upgrades a CRD: the API server drops the fields the installed schema lacks from policies written without strict validation (this chart's own defaultPolicy among them). %s" $key (ternary (printf "%.12s…" $have) "missing" (ne $have "")) (default "unknown" $haveVersion) (printf "%.12s…" $want) .Chart.Version $fix) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Where users get this chart, for the commands the chart's messages print. */}}
{{- define "nodeguard.chartRef" -}}
oci://ghcr.io/nodeguard/charts/nodeguard
{{- end -}}

{{/* "true" when unit (a systemd unit name) is allowed by the list of
trust.repairUnits entries (exact, or a prefix ending in '*'); "" otherwise. */}}
{{- define "nodeguard.unitAllowed" -}}
{{- $unit := index . 0 -}}
{{- range $e := (index . 1 | default list) -}}
{{- if or (eq $e $unit) (and (hasSuffix "*" $e) (hasPrefix (trimSuffix "*" $e) $unit)) -}}true{{- end -}}
{{- end -}}
{{- end -}}

{{/* Fails unless the program (an absolute path) is allowed on the nodes:
in trust.commands (exact, or under an entry ending in '/') or under
host.plugins.path with host.plugins on. Arguments: root context, program,
who runs it. */}}
{{- define "nodeguard.checkCommand" -}}
{{- $root := index . 0 -}}
{{- $prog := index . 1 -}}
{{- $who := index . 2 -}}
{{- $entries := $root.Values.trust.commands | default list -}}
{{- if $root.Values.host.plugins.enabled -}}
{{- $entries = append $entries (printf "%s/" (trimSuffix "/" $root.Values.host.plugins.path)) -}}
{{- end -}}
{{- $ok := false -}}
{{- range $e := $entries -}}
{{- if or (eq $e $prog) (and (hasSuffix "/" $e) (hasPrefix $e $prog)) -}}{{- $ok = true -}}{{- end -}}
{{- end -}}
{{- if not $ok -}}
{{- fail (printf "defaultPolicy: %s runs %s, which the nodes do not allow: add it to trust.commands, or put it in host.plugins.path with host.plugins.enabled=true" $who $prog) -}}
{{- end -}}
{{- end -}}
