{{/*
Helpers of the larql-grid chart. Every Deployment of a larql role (router, ffn ranges, embed, serve)
comes from "larql-grid.deployment"; the edge has its own template (different probes and volumes)
but shares the names, labels, security contexts and spread constraints defined here.
*/}}

{{- define "larql-grid.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "larql-grid.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* A child object's name, "<fullname>-<suffix>". Services need DNS labels, so a name that would
not fit 63 characters fails instead of being cut (two cut names could collide). */}}
{{- define "larql-grid.child" -}}
{{- $name := printf "%s-%s" (include "larql-grid.fullname" .ctx) .suffix -}}
{{- if gt (len $name) 63 -}}
{{- fail (printf "the object name %q is longer than 63 characters: set fullnameOverride (or a shorter release name / ffn range name)" $name) -}}
{{- end -}}
{{- $name -}}
{{- end -}}

{{- define "larql-grid.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Selector labels: name, instance, component (+ the FFN range label for a range). */}}
{{- define "larql-grid.selectorLabels" -}}
app.kubernetes.io/name: {{ include "larql-grid.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- with .layers }}
larql-edge/layers: {{ . | quote }}
{{- end }}
{{- end -}}

{{- define "larql-grid.labels" -}}
helm.sh/chart: {{ include "larql-grid.chart" .ctx }}
{{ include "larql-grid.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: larql-grid
{{- end -}}

{{- define "larql-grid.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "larql-grid.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* registry/repository:tag of a component image ({repository, tag}). */}}
{{- define "larql-grid.image" -}}
{{- $v := .ctx.Values -}}
{{- $tag := .image.tag | default $v.image.tag | toString -}}
{{- if $v.image.registry -}}
{{- printf "%s/%s:%s" (trimSuffix "/" $v.image.registry) .image.repository $tag -}}
{{- else -}}
{{- printf "%s:%s" .image.repository $tag -}}
{{- end -}}
{{- end -}}

{{/* The routers' headless Service: resolves to every ready router pod. Members join each address
(LARQL_JOIN), serve and the test pod fail over between them (LARQL_FFN). */}}
{{- define "larql-grid.routerHeadless" -}}
{{- include "larql-grid.child" (dict "ctx" . "suffix" "router-headless") -}}
{{- end -}}

{{- define "larql-grid.routerUrl" -}}
{{- printf "%s://%s.%s.svc:9090" (include "larql-grid.scheme" .) (include "larql-grid.routerHeadless" .) .Release.Namespace -}}
{{- end -}}

{{- define "larql-grid.scheme" -}}
{{- ternary "https" "http" (.Values.tls.enabled | default false) -}}
{{- end -}}

{{/* TLS: the Secret of a component (dict ctx component): tls.secretNames.<component> or <fullname>-<component>-tls. */}}
{{- define "larql-grid.tlsSecret" -}}
{{- $n := get .ctx.Values.tls.secretNames .component | default "" -}}
{{- $n | default (include "larql-grid.child" (dict "ctx" .ctx "suffix" (printf "%s-tls" .component))) -}}
{{- end -}}

{{/* The name every server certificate also covers: the ServiceMonitor's serverName (it scrapes pod IPs). */}}
{{- define "larql-grid.metricsName" -}}
{{- include "larql-grid.child" (dict "ctx" . "suffix" "metrics") -}}
{{- end -}}

{{/* The headless Service whose CoreDNS endpoint names a member announces (dict ctx component name). */}}
{{- define "larql-grid.memberHeadless" -}}
{{- if eq .component "embed" -}}
{{- include "larql-grid.child" (dict "ctx" .ctx "suffix" "embed-headless") -}}
{{- else -}}
{{- .name -}}
{{- end -}}
{{- end -}}

{{/* The DNS names a Service is reached by (dict ctx svc): short, .ns, .ns.svc, .ns.svc.<clusterDomain>. */}}
{{- define "larql-grid.svcNames" -}}
{{- $ns := .ctx.Release.Namespace -}}
{{- $cd := .ctx.Values.tls.clusterDomain -}}
{{- toYaml (list .svc (printf "%s.%s" .svc $ns) (printf "%s.%s.svc" .svc $ns) (printf "%s.%s.svc.%s" .svc $ns $cd)) -}}
{{- end -}}

{{/* TLS environment of a larql role (dict ctx component). */}}
{{- define "larql-grid.tlsEnv" -}}
{{- $t := .ctx.Values.tls -}}
- {name: LARQL_TLS_CERT_FILE, value: /var/run/secrets/larql/tls/tls.crt}
- {name: LARQL_TLS_KEY_FILE, value: /var/run/secrets/larql/tls/tls.key}
- {name: LARQL_TLS_CA_FILE, value: /var/run/secrets/larql/tls/ca.crt}
{{- if or (and $t.mutual (has .component (list "router" "ffn" "embed"))) (and (eq .component "serve") $t.serveClientAuth) }}
- {name: LARQL_TLS_CLIENT_CA_FILE, value: /var/run/secrets/larql/tls/ca.crt}
{{- end }}
{{- end -}}

{{/* The Secret volume of a component's certificate (dict ctx component). */}}
{{- define "larql-grid.tlsVolume" -}}
- name: tls
  secret:
    secretName: {{ include "larql-grid.tlsSecret" . }}
    defaultMode: 288 # 0440: the pods' group (fsGroup) reads it
    items:
      - {key: tls.crt, path: tls.crt}
      - {key: tls.key, path: tls.key}
      - {key: ca.crt, path: ca.crt}
{{- end -}}

{{- define "larql-grid.embedService" -}}
{{- include "larql-grid.child" (dict "ctx" . "suffix" "embed") -}}
{{- end -}}

{{/*
The FFN ranges with the ffn block's defaults applied, as YAML {ranges: [...]}: each entry gets
name, first, last and every key of the ffn block that the range does not set itself (a key a range
sets replaces the default whole: no deep merge, so `autoscaling: {enabled: false}` means exactly
that). Use: (include "larql-grid.ffnRanges" . | fromYaml).ranges
*/}}
{{- define "larql-grid.ffnRanges" -}}
{{- $defaults := omit .Values.ffn "ranges" -}}
{{- $out := list -}}
{{- range $i, $r := .Values.ffn.ranges -}}
{{- $spec := toString $r.layers -}}
{{- $parts := split "-" $spec -}}
{{- $m := deepCopy $defaults -}}
{{- range $k, $val := $r -}}
{{- $_ := set $m $k $val -}}
{{- end -}}
{{- $_ := set $m "first" (atoi $parts._0) -}}
{{- $_ := set $m "last" (atoi $parts._1) -}}
{{- $_ := set $m "layers" $spec -}}
{{- $_ := set $m "name" (toString ($r.name | default $spec)) -}}
{{- $out = append $out $m -}}
{{- end -}}
{{- toYaml (dict "ranges" $out) -}}
{{- end -}}

{{/*
Checks that make `helm template` / `helm install` fail with a message instead of deploying a grid
that cannot serve: every layer 0..numLayers-1 in exactly one FFN range, the ranges inside the
model, the secrets and the model source complete.
*/}}
{{- define "larql-grid.validate" -}}
{{- $v := .Values -}}
{{- $n := int $v.model.numLayers -}}
{{- if lt $n 1 -}}
{{- fail (printf "model.numLayers must be at least 1 (got %d)" $n) -}}
{{- end -}}
{{- if not $v.ffn.ranges -}}
{{- fail "ffn.ranges is empty: give at least one layer range, e.g. ffn.ranges[0].layers=0-17" -}}
{{- end -}}
{{- $owner := dict -}}
{{- $names := dict -}}
{{- range $i, $r := $v.ffn.ranges -}}
{{- $spec := toString $r.layers -}}
{{- if not (regexMatch "^[0-9]+-[0-9]+$" $spec) -}}
{{- fail (printf "ffn.ranges[%d].layers is %q: want an inclusive range A-B such as \"0-8\"" $i $spec) -}}
{{- end -}}
{{- $parts := split "-" $spec -}}
{{- $a := atoi $parts._0 -}}
{{- $b := atoi $parts._1 -}}
{{- if gt $a $b -}}
{{- fail (printf "ffn.ranges[%d].layers %q starts after it ends" $i $spec) -}}
{{- end -}}
{{- if ge $b $n -}}
{{- fail (printf "ffn.ranges[%d].layers %q goes beyond the model: model.numLayers is %d, so the last layer is %d" $i $spec $n (sub $n 1)) -}}
{{- end -}}
{{- range $l := untilStep $a (int (add1 $b)) 1 -}}
{{- $k := toString $l -}}
{{- if hasKey $owner $k -}}
{{- fail (printf "ffn.ranges overlap: layer %d is in both %q and %q (every layer must be in exactly one range)" $l (get $owner $k) $spec) -}}
{{- end -}}
{{- $_ := set $owner $k $spec -}}
{{- end -}}
{{- $name := toString ($r.name | default $spec) -}}
{{- if hasKey $names $name -}}
{{- fail (printf "ffn.ranges: two ranges are named %q" $name) -}}
{{- end -}}
{{- $_ := set $names $name true -}}
{{- end -}}
{{- $gaps := list -}}
{{- range $l := until $n -}}
{{- if not (hasKey $owner (toString $l)) -}}
{{- $gaps = append $gaps (toString $l) -}}
{{- end -}}
{{- end -}}
{{- if $gaps -}}
{{- fail (printf "ffn.ranges leave layer(s) %s uncovered: every layer 0-%d of the model must be in exactly one range" (join ", " $gaps) (sub $n 1)) -}}
{{- end -}}
{{- if not $v.gridKey.existingSecret -}}
{{- fail "gridKey.existingSecret is empty: create the Secret first (kubectl create secret generic larql-grid-key --from-literal=grid-key=\"$(openssl rand -hex 32)\") and name it here" -}}
{{- end -}}
{{- if not (has $v.model.source (list "image" "hub")) -}}
{{- fail (printf "model.source is %q: want image or hub" $v.model.source) -}}
{{- end -}}
{{- if and (eq $v.model.source "hub") (not $v.model.hub.repo) -}}
{{- fail "model.source is hub but model.hub.repo is empty: name the vindex repo (OWNER/NAME)" -}}
{{- end -}}
{{- if not (has $v.edge.type (list "nginx" "varnish")) -}}
{{- fail (printf "edge.type is %q: want nginx or varnish" $v.edge.type) -}}
{{- end -}}
{{- if and $v.tls.enabled $v.edge.enabled (eq $v.edge.type "varnish") -}}
{{- fail "tls.enabled with edge.type varnish: Varnish speaks no TLS (to clients or to the embed servers); use edge.type nginx" -}}
{{- end -}}
{{- if and $v.tls.certManager.enabled (not $v.tls.enabled) -}}
{{- fail "tls.certManager.enabled needs tls.enabled: the Certificates would be made and never used" -}}
{{- end -}}
{{- end -}}

{{/* Pod-level settings shared by every pod of the chart. */}}
{{- define "larql-grid.podCommon" -}}
{{- $v := .Values -}}
serviceAccountName: {{ include "larql-grid.serviceAccountName" . }}
automountServiceAccountToken: {{ $v.automountServiceAccountToken }}
{{- /* Kubernetes would otherwise inject <SERVICE>_PORT=tcp://... variables; a Service named
"larql" would set LARQL_PORT, which is a flag twin of every role. */}}
enableServiceLinks: false
securityContext: {{- toYaml $v.podSecurityContext | nindent 2 }}
{{- with $v.imagePullSecrets }}
imagePullSecrets: {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* nodeSelector, tolerations, affinity, priority and the hostname spread of one component. */}}
{{- define "larql-grid.scheduling" -}}
{{- $v := .ctx.Values -}}
{{- $cfg := .cfg -}}
{{- with $cfg.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with $cfg.nodeSelector }}
nodeSelector: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $cfg.tolerations }}
tolerations: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $cfg.affinity }}
affinity: {{- toYaml . | nindent 2 }}
{{- end }}
{{- if or $v.topologySpread.enabled $cfg.topologySpreadConstraints }}
topologySpreadConstraints:
{{- if $v.topologySpread.enabled }}
  - maxSkew: {{ int $v.topologySpread.maxSkew }}
    topologyKey: {{ $v.topologySpread.topologyKey }}
    whenUnsatisfiable: {{ $v.topologySpread.whenUnsatisfiable }}
    labelSelector:
      matchLabels: {{- toYaml .selector | nindent 8 }}
    matchLabelKeys: [pod-template-hash]
{{- end }}
{{- with $cfg.topologySpreadConstraints }}
{{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
{{- end -}}

{{/* startup / readiness / liveness of a larql role: GET /v1/health, /v1/ready, /v1/health. With TLS
these are exec probes (larql-healthcheck over https on loopback, presenting the pod's certificate):
kubelet's httpGet cannot show a client certificate, and mutual TLS refuses it (DESIGN.md §14). */}}
{{- define "larql-grid.probes" -}}
{{- $v := .ctx.Values -}}
{{- $own := .cfg.probes | default dict -}}
{{- $port := .port -}}
{{- range $kind := list "startup" "readiness" "liveness" }}
{{ $kind }}Probe:
  {{- if $v.tls.enabled }}
  exec:
    command: [larql-healthcheck, {{ printf "http://127.0.0.1:%v%s" $port (ternary "/v1/ready" "/v1/health" (eq $kind "readiness")) | quote }}]
  {{- else }}
  httpGet:
    path: {{ if eq $kind "readiness" }}/v1/ready{{ else }}/v1/health{{ end }}
    port: http
  {{- end }}
  {{- toYaml (mergeOverwrite (deepCopy (get $v.probes $kind)) (get $own $kind | default dict)) | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The init container that pulls a preset from the Hub into the vindex volume (model.source=hub). */}}
{{- define "larql-grid.pullInit" -}}
{{- $v := .ctx.Values -}}
{{- $hub := $v.model.hub -}}
- name: pull-{{ .preset }}
  image: {{ include "larql-grid.image" (dict "ctx" .ctx "image" (dict "repository" "larql-slicer" "tag" "")) }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  command: [larql-entrypoint, larql-slicer]
  args:
    - pull
    - {{ $hub.repo | quote }}
    - --preset
    - {{ .preset | quote }}
    - -o
    - /models/vindex
    {{- with $hub.revision }}
    - --revision
    - {{ . | quote }}
    {{- end }}
  env:
    - name: LARQL_REPO_TYPE
      value: {{ $hub.repoType | quote }}
    {{- with $hub.endpoint }}
    - name: HF_ENDPOINT
      value: {{ . | quote }}
    {{- end }}
    {{- with $hub.mirror }}
    - name: LARQL_MIRROR
      value: {{ . | quote }}
    {{- end }}
    # huggingface_hub's own cache and lock files: the root filesystem is read-only.
    - name: HF_HOME
      value: /tmp/hf-home
    - name: LARQL_CACHE_DIR
      value: /home/larql/.cache/larql-edge
    {{- if $hub.tokenSecret.name }}
    - name: LARQL_HF_TOKEN_FILE
      value: /var/run/secrets/larql/hf-token/token
    {{- end }}
  resources: {{- toYaml $hub.initResources | nindent 4 }}
  securityContext: {{- toYaml $v.containerSecurityContext | nindent 4 }}
  volumeMounts:
    - {name: vindex, mountPath: /models}
    - {name: tmp, mountPath: /tmp}
    - {name: cache, mountPath: /home/larql/.cache/larql-edge}
    {{- if $hub.tokenSecret.name }}
    - {name: hf-token, mountPath: /var/run/secrets/larql/hf-token, readOnly: true}
    {{- end }}
{{- end -}}

{{/* Volumes of a role pod: /tmp, the cache dir, the grid key, and the pulled vindex. */}}
{{- define "larql-grid.volumes" -}}
{{- $v := .ctx.Values -}}
- name: tmp
  emptyDir: {sizeLimit: {{ $v.tmpSizeLimit }}}
- name: cache
  emptyDir: {sizeLimit: {{ .cfg.cacheSizeLimit }}}
{{- if .gridKey }}
- name: grid-key
  secret:
    secretName: {{ $v.gridKey.existingSecret }}
    defaultMode: 288 # 0440: the pods' group (fsGroup) reads it, nobody writes it
    items:
      - {key: {{ $v.gridKey.key }}, path: grid-key}
{{- end }}
{{- if .preset }}
{{- $vol := $v.model.hub.volume | default (dict "emptyDir" (dict "sizeLimit" $v.model.hub.volumeSizeLimit)) }}
{{- if ne (len $vol) 1 }}
{{- fail (printf "model.hub.volume must hold exactly one volume source (emptyDir, ephemeral, persistentVolumeClaim, ...), got: %s" (keys $vol | sortAlpha | join ", ")) }}
{{- end }}
- name: vindex
  {{- toYaml $vol | nindent 2 }}
{{- if $v.model.hub.tokenSecret.name }}
- name: hf-token
  secret:
    secretName: {{ $v.model.hub.tokenSecret.name }}
    defaultMode: 288 # 0440
    items:
      - {key: {{ $v.model.hub.tokenSecret.key }}, path: token}
{{- end }}
{{- end }}
{{- end -}}

{{/*
A Deployment of a larql role. Parameters (a dict):
  ctx        the root context
  name       the object name
  component  router | ffn | embed | serve
  layers     the FFN range label value ("" for other components)
  cfg        the component's values (replicas, image, resources, probes, autoscaling, ...)
  port       the container port (also LARQL_PORT)
  preset     the Hub preset to pull when model.source is hub ("" = none)
  gridKey    mount the grid key and set LARQL_GRID_KEY_FILE
  member     join the routers: LARQL_JOIN, LARQL_PUBLIC_URL (pod IP; with TLS its headless-Service DNS name)
  env        the role's own environment ([{name, value}])
*/}}
{{- define "larql-grid.deployment" -}}
{{- $ctx := .ctx -}}
{{- $v := $ctx.Values -}}
{{- $cfg := .cfg -}}
{{- $sel := include "larql-grid.selectorLabels" (dict "ctx" $ctx "component" .component "layers" .layers) | fromYaml -}}
{{- $hub := and (eq $v.model.source "hub") .preset -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ .name }}
  labels: {{- include "larql-grid.labels" (dict "ctx" $ctx "component" .component "layers" .layers) | nindent 4 }}
spec:
  {{- if not $cfg.autoscaling.enabled }}
  replicas: {{ int $cfg.replicas }}
  {{- end }}
  revisionHistoryLimit: 5
  selector:
    matchLabels: {{- toYaml $sel | nindent 6 }}
  strategy:
    type: RollingUpdate
    rollingUpdate: {{- toYaml $v.rollingUpdate | nindent 6 }}
  template:
    metadata:
      labels: {{- include "larql-grid.labels" (dict "ctx" $ctx "component" .component "layers" .layers) | nindent 8 }}
        {{- with $cfg.podLabels }}{{ toYaml . | nindent 8 }}{{ end }}
      annotations:
        {{- if $v.metrics.podAnnotations }}
        prometheus.io/scrape: "true"
        {{- if $v.tls.enabled }}
        prometheus.io/scheme: https
        {{- end }}
        prometheus.io/port: {{ .port | quote }}
        prometheus.io/path: /metrics
        {{- end }}
        {{- with $cfg.podAnnotations }}{{ toYaml . | nindent 8 }}{{ end }}
    spec:
      {{- include "larql-grid.podCommon" $ctx | trim | nindent 6 }}
      terminationGracePeriodSeconds: {{ int $v.terminationGracePeriodSeconds }}
      {{- with (include "larql-grid.scheduling" (dict "ctx" $ctx "cfg" $cfg "selector" $sel) | trim) }}{{ . | nindent 6 }}{{ end }}
      {{- if $hub }}
      initContainers: {{- include "larql-grid.pullInit" (dict "ctx" $ctx "preset" .preset) | nindent 8 }}
      {{- end }}
      containers:
        - name: {{ .component }}
          image: {{ include "larql-grid.image" (dict "ctx" $ctx "image" $cfg.image) }}
          imagePullPolicy: {{ $v.image.pullPolicy }}
          ports:
            - {name: http, containerPort: {{ .port }}, protocol: TCP}
          env:
            - {name: LARQL_PORT, value: {{ .port | quote }}}
            - {name: LARQL_LOG_LEVEL, value: {{ $v.logLevel | quote }}}
            - {name: LARQL_BLAS_THREADS, value: {{ $cfg.blasThreads | quote }}}
            - {name: LARQL_DRAIN_SECONDS, value: {{ $v.drainSeconds | quote }}}
            - {name: LARQL_CACHE_DIR, value: /home/larql/.cache/larql-edge}
            {{- if $hub }}
            - {name: LARQL_VINDEX, value: /models/vindex}
            {{- end }}
            {{- if .gridKey }}
            - {name: LARQL_GRID_KEY_FILE, value: /var/run/secrets/larql/grid-key/grid-key}
            {{- end }}
            {{- if .member }}
            - name: POD_IP
              valueFrom: {fieldRef: {fieldPath: status.podIP}}
            - {name: LARQL_JOIN, value: {{ include "larql-grid.routerUrl" $ctx | quote }}}
            {{- if $v.tls.enabled }}
            # CoreDNS's name of this pod's endpoint in its headless Service, which the certificate
            # covers with a wildcard; larql-entrypoint fills in {pod-ip-dashed} from POD_IP.
            - {name: LARQL_PUBLIC_URL, value: {{ printf "https://{pod-ip-dashed}.%s.%s.svc.%s:%v" (include "larql-grid.memberHeadless" (dict "ctx" $ctx "component" .component "name" .name)) $ctx.Release.Namespace $v.tls.clusterDomain .port | quote }}}
            {{- else }}
            - {name: LARQL_PUBLIC_URL, value: "http://$(POD_IP):{{ .port }}"}
            {{- end }}
            {{- end }}
            {{- if $v.tls.enabled }}
            {{- include "larql-grid.tlsEnv" (dict "ctx" $ctx "component" .component) | nindent 12 }}
            {{- end }}
            {{- with .env }}{{ toYaml . | nindent 12 }}{{ end }}
            {{- with $cfg.extraEnv }}{{ toYaml . | nindent 12 }}{{ end }}
          {{- include "larql-grid.probes" (dict "ctx" $ctx "cfg" $cfg "port" .port) | trim | nindent 10 }}
          lifecycle:
            preStop:
              # Leave every router, turn /v1/ready to 503, wait LARQL_DRAIN_SECONDS for in-flight work.
              exec: {command: [larql-leave]}
          resources: {{- toYaml $cfg.resources | nindent 12 }}
          securityContext: {{- toYaml $v.containerSecurityContext | nindent 12 }}
          volumeMounts:
            - {name: tmp, mountPath: /tmp}
            - {name: cache, mountPath: /home/larql/.cache/larql-edge}
            {{- if .gridKey }}
            - {name: grid-key, mountPath: /var/run/secrets/larql/grid-key, readOnly: true}
            {{- end }}
            {{- if $hub }}
            - {name: vindex, mountPath: /models, readOnly: true}
            {{- end }}
            {{- if $v.tls.enabled }}
            - {name: tls, mountPath: /var/run/secrets/larql/tls, readOnly: true}
            {{- end }}
      volumes: {{- include "larql-grid.volumes" (dict "ctx" $ctx "cfg" $cfg "gridKey" .gridKey "preset" (ternary .preset "" (eq $v.model.source "hub"))) | nindent 8 }}
        {{- if $v.tls.enabled }}
        {{- include "larql-grid.tlsVolume" (dict "ctx" $ctx "component" .component) | nindent 8 }}
        {{- end }}
{{- end -}}

{{/* A PodDisruptionBudget for one component (cfg.pdb: enabled, minAvailable or maxUnavailable). */}}
{{- define "larql-grid.pdb" -}}
{{- if .cfg.pdb.enabled }}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ .name }}
  labels: {{- include "larql-grid.labels" (dict "ctx" .ctx "component" .component "layers" .layers) | nindent 4 }}
spec:
  {{- if hasKey .cfg.pdb "maxUnavailable" }}
  maxUnavailable: {{ .cfg.pdb.maxUnavailable }}
  {{- else }}
  minAvailable: {{ .cfg.pdb.minAvailable | default 1 }}
  {{- end }}
  # An unready pod (still loading, or stuck) may be evicted: it serves nothing anyway, and a drain
  # must not wait on it.
  unhealthyPodEvictionPolicy: AlwaysAllow
  selector:
    matchLabels: {{- include "larql-grid.selectorLabels" (dict "ctx" .ctx "component" .component "layers" .layers) | nindent 6 }}
{{- end }}
{{- end -}}

{{/* A HorizontalPodAutoscaler on a per-pod gauge from the custom metrics API (prometheus-adapter). */}}
{{- define "larql-grid.hpa" -}}
{{- $a := .cfg.autoscaling -}}
{{- if $a.enabled }}
{{- if gt (int $a.minReplicas) (int $a.maxReplicas) }}
{{- fail (printf "%s: autoscaling.minReplicas (%d) is above maxReplicas (%d)" .name (int $a.minReplicas) (int $a.maxReplicas)) }}
{{- end }}
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ .name }}
  labels: {{- include "larql-grid.labels" (dict "ctx" .ctx "component" .component "layers" .layers) | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ .name }}
  minReplicas: {{ int $a.minReplicas }}
  maxReplicas: {{ int $a.maxReplicas }}
  metrics:
    - type: Pods
      pods:
        metric:
          name: {{ $a.metric }}
        target:
          type: AverageValue
          averageValue: {{ $a.targetAverageValue | quote }}
  behavior:
    scaleUp:
      stabilizationWindowSeconds: 30
      policies:
        - {type: Pods, value: 2, periodSeconds: 60}
    scaleDown:
      # A new shard loads its weights before it is ready: do not flap.
      stabilizationWindowSeconds: 300
      policies:
        - {type: Pods, value: 1, periodSeconds: 120}
{{- end }}
{{- end -}}

{{/* A NetworkPolicyPeer: the pods of one component of this release. */}}
{{- define "larql-grid.peer" -}}
- podSelector:
    matchLabels: {{- include "larql-grid.selectorLabels" . | nindent 6 }}
{{- end -}}

{{/*
TLS: the names a component's certificate must cover (dict ctx component), as a YAML list: its
Services by every DNS form, the wildcard over its headless Service's endpoint names (members: the
names they announce), and the metrics name (the ServiceMonitor scrapes pod IPs under it).
*/}}
{{- define "larql-grid.tlsNames" -}}
{{- $ctx := .ctx -}}
{{- $v := $ctx.Values -}}
{{- $ns := $ctx.Release.Namespace -}}
{{- $cd := $v.tls.clusterDomain -}}
{{- $svcs := list -}}
{{- $wild := list -}}
{{- if eq .component "router" -}}
{{- $svcs = list (include "larql-grid.child" (dict "ctx" $ctx "suffix" "router")) (include "larql-grid.routerHeadless" $ctx) -}}
{{- else if eq .component "ffn" -}}
{{- range $r := (include "larql-grid.ffnRanges" $ctx | fromYaml).ranges -}}
{{- $svc := include "larql-grid.child" (dict "ctx" $ctx "suffix" (printf "ffn-%s" $r.name)) -}}
{{- $svcs = append $svcs $svc -}}
{{- $wild = append $wild $svc -}}
{{- end -}}
{{- else if eq .component "embed" -}}
{{- $e := include "larql-grid.embedService" $ctx -}}
{{- $h := include "larql-grid.memberHeadless" (dict "ctx" $ctx "component" "embed" "name" $e) -}}
{{- $svcs = list $e $h -}}
{{- $wild = list $h -}}
{{- else if eq .component "serve" -}}
{{- $svcs = list (include "larql-grid.child" (dict "ctx" $ctx "suffix" "serve")) -}}
{{- else if eq .component "edge" -}}
{{- $svcs = list (include "larql-grid.child" (dict "ctx" $ctx "suffix" "edge")) -}}
{{- end -}}
{{- $out := list -}}
{{- range $s := $svcs -}}
{{- $out = concat $out (include "larql-grid.svcNames" (dict "ctx" $ctx "svc" $s) | fromYamlArray) -}}
{{- end -}}
{{- range $s := $wild -}}
{{- $out = append $out (printf "*.%s.%s.svc.%s" $s $ns $cd) -}}
{{- end -}}
{{- if has .component (list "router" "ffn" "embed" "serve") -}}
{{- $out = append $out (include "larql-grid.metricsName" $ctx) -}}
{{- end -}}
{{- if eq .component "client" -}}
{{- $out = list (include "larql-grid.child" (dict "ctx" $ctx "suffix" "client")) -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{/* The components that get a certificate in this release. */}}
{{- define "larql-grid.tlsComponents" -}}
{{- $v := .Values -}}
{{- $c := list "router" "ffn" "embed" "client" -}}
{{- if $v.serve.enabled }}{{ $c = append $c "serve" }}{{ end -}}
{{- if $v.edge.enabled }}{{ $c = append $c "edge" }}{{ end -}}
{{- toYaml $c -}}
{{- end -}}
