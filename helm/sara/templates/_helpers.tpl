{{/*
Names, labels, images and the pieces every pod shares.
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "sara.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The resource-name prefix: fullnameOverride, else RELEASE-NAME (just RELEASE when the
release name already contains the chart name). Cut to 63 characters minus the longest
suffix a resource adds ("-operator"), so every name stays a valid DNS label.
*/}}
{{- define "sara.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 54 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 54 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 54 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* chart-version, as the helm.sh/chart label. */}}
{{- define "sara.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels that select one component's pods: call with (dict "ctx" $ "component" "router"). */}}
{{- define "sara.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sara.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Every label of a component's resources: call with (dict "ctx" $ "component" "router"). */}}
{{- define "sara.labels" -}}
helm.sh/chart: {{ include "sara.chart" .ctx }}
{{ include "sara.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: sara
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Labels of a component's pods: no chart version, so a chart-only upgrade does not
restart the GPU workers. Call with (dict "ctx" $ "component" "router").
*/}}
{{- define "sara.podLabels" -}}
{{ include "sara.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: sara
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The SARA image: call with (dict "ctx" $ "image" <override with repository/tag, or empty>). */}}
{{- define "sara.image" -}}
{{- $img := .ctx.Values.image }}
{{- $override := .image | default dict }}
{{- $repository := $override.repository | default $img.repository }}
{{- $tag := $override.tag | default $img.tag | default .ctx.Chart.AppVersion }}
{{- if and $img.digest (not $override.repository) }}
{{- printf "%s@%s" $repository $img.digest }}
{{- else }}
{{- printf "%s:%s" $repository (toString $tag) }}
{{- end }}
{{- end }}

{{/* Name of the operator's ServiceAccount. */}}
{{- define "sara.operator.serviceAccountName" -}}
{{- if .Values.operator.serviceAccount.create }}
{{- default (printf "%s-operator" (include "sara.fullname" .)) .Values.operator.serviceAccount.name }}
{{- else }}
{{- required "operator.serviceAccount.name is required when operator.serviceAccount.create is false" .Values.operator.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Secret and key of the API token. */}}
{{- define "sara.apiToken.secretName" -}}
{{- default (printf "%s-api-token" (include "sara.fullname" .)) .Values.apiToken.existingSecret }}
{{- end }}
{{- define "sara.apiToken.secretKey" -}}
{{- if .Values.apiToken.existingSecret }}{{ .Values.apiToken.existingSecretKey }}{{ else }}token{{ end }}
{{- end }}

{{/*
Secret and key of the Redis URL. Exactly one Redis: the in-chart one (redis.enabled),
or an external one (redis.external.url or redis.external.existingSecret). The schema
says so too; this check also names the fix.
*/}}
{{- define "sara.redis.check" -}}
{{- $ext := .Values.redis.external }}
{{- if and .Values.redis.enabled (or $ext.url $ext.existingSecret) }}
{{- fail "redis: choose one Redis: redis.enabled=true (in-chart) or redis.external.url/existingSecret (external), not both" }}
{{- end }}
{{- if and (not .Values.redis.enabled) (not (or $ext.url $ext.existingSecret)) }}
{{- fail "redis.external.url: required when redis.enabled=false (or set redis.external.existingSecret)" }}
{{- end }}
{{- if and $ext.url $ext.existingSecret }}
{{- fail "redis.external: set url or existingSecret, not both" }}
{{- end }}
{{- end }}
{{- define "sara.redis.fullname" -}}
{{- printf "%s-redis" (include "sara.fullname" .) }}
{{- end }}
{{- define "sara.redis.secretName" -}}
{{- if .Values.redis.external.existingSecret }}
{{- .Values.redis.external.existingSecret }}
{{- else }}
{{- printf "%s-redis" (include "sara.fullname" .) }}
{{- end }}
{{- end }}
{{- define "sara.redis.secretKey" -}}
{{- if .Values.redis.external.existingSecret }}{{ .Values.redis.external.existingSecretKey }}{{ else }}redis-url{{ end }}
{{- end }}

{{/* The REDIS_URL variable: the args reference it as $(REDIS_URL), so no secret is in the spec. */}}
{{- define "sara.redis.env" -}}
- name: REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "sara.redis.secretName" . }}
      key: {{ include "sara.redis.secretKey" . }}
{{- end }}

{{/* The --model argument. */}}
{{- define "sara.model.path" -}}
{{- default (printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) .Values.model.name) .Values.model.path }}
{{- end }}

{{/* The model volume (mounted read-only). */}}
{{- define "sara.model.volume" -}}
{{- $v := .Values.model.volume -}}
- name: model
{{- if eq $v.type "persistentVolumeClaim" }}
  persistentVolumeClaim:
    claimName: {{ required "model.volume.claimName is required when model.volume.type is persistentVolumeClaim" $v.claimName }}
    readOnly: true
{{- else if eq $v.type "hostPath" }}
  hostPath:
    path: {{ required "model.volume.hostPath is required when model.volume.type is hostPath" $v.hostPath }}
    type: Directory
{{- else }}
{{- if $v.sizeLimit }}
  emptyDir:
    sizeLimit: {{ $v.sizeLimit }}
{{- else }}
  emptyDir: {}
{{- end }}
{{- end }}
{{- end }}
{{- define "sara.model.volumeMount" -}}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}

{{/*
Pod and container security: non-root, read-only root, no privilege escalation, no
capabilities, the runtime's seccomp profile. Every pod of the chart uses these.
*/}}
{{- define "sara.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.securityContext.runAsUser }}
runAsGroup: {{ .Values.securityContext.runAsUser }}
fsGroup: {{ .Values.securityContext.fsGroup }}
seccompProfile:
  type: RuntimeDefault
{{- end }}
{{- define "sara.containerSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.securityContext.runAsUser }}
runAsGroup: {{ .Values.securityContext.runAsUser }}
readOnlyRootFilesystem: true
allowPrivilegeEscalation: false
privileged: false
capabilities:
  drop:
    - ALL
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* The writable /tmp of every pod (the root filesystem is read-only). */}}
{{- define "sara.tmp.volume" -}}
- name: tmp
  emptyDir: {}
{{- end }}
{{- define "sara.tmp.volumeMount" -}}
- name: tmp
  mountPath: /tmp
{{- end }}

{{/* imagePullSecrets of every pod. */}}
{{- define "sara.imagePullSecrets" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
{{- range . }}
  - name: {{ . }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Whether the operator owns the pools' replica counts: an SLOAutoscaler of this chart in
active mode. Then the Deployments leave spec.replicas out, so `helm upgrade` never
undoes a scaling decision.
*/}}
{{- define "sara.autoscalerOwnsReplicas" -}}
{{- if and .Values.autoscaler.create (eq .Values.autoscaler.mode "active") }}true{{ end }}
{{- end }}

{{/*
The scale target of a pool as a dict (apiVersion, kind, name, resource): its
autoscaler.POOL.scaleTargetRef when that names a kind, else this release's own
Deployment (the engine's with engines.enabled, SARA's workers otherwise). resource is
the plural the RBAC rules name: scaleTargetRef.resource, else the kind in lower case
plus "s" (statefulsets, leaderworkersets). Call with (dict "ctx" $ "pool" "prefill").
*/}}
{{- define "sara.scaleTarget" -}}
{{- $ref := (index .ctx.Values.autoscaler .pool).scaleTargetRef | default dict }}
{{- if $ref.kind }}
{{- if not (and $ref.apiVersion $ref.name) }}
{{- fail (printf "autoscaler.%s.scaleTargetRef: apiVersion, kind and name are all required" .pool) }}
{{- end }}
{{- toYaml (dict "apiVersion" $ref.apiVersion "kind" $ref.kind "name" $ref.name "resource" ($ref.resource | default (printf "%ss" (lower $ref.kind)))) }}
{{- else }}
{{- $name := printf "%s-%s" (include "sara.fullname" .ctx) (ternary (printf "engine-%s" .pool) .pool .ctx.Values.engines.enabled) }}
{{- toYaml (dict "apiVersion" "apps/v1" "kind" "Deployment" "name" $name "resource" "deployments") }}
{{- end }}
{{- end }}
