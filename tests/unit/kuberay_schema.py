"""JSON schema of the KubeRay `RayJob` (ray.io/v1) fields posttrain's manifest uses.

A subset of KubeRay's CRD (`ray-operator/config/crd/bases/ray.io_rayjobs.yaml`) and of the
Kubernetes core types it embeds (PodTemplateSpec, Container, Volume), transcribed by hand: the
field names and types are KubeRay's and Kubernetes', and objects whose fields are all listed
forbid unknown ones, so a misspelt key (`replica`, `rayStartParam`, `volumeMount`) fails the test
instead of being dropped silently by the API server's pruning.
"""

QUANTITY = {"anyOf": [{"type": "integer"}, {"type": "string", "pattern": r"^[0-9.]+([KMGTPE]i?|m|[eE][0-9]+)?$"}]}
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}

RESOURCES = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "limits": {"type": "object", "additionalProperties": QUANTITY},
        "requests": {"type": "object", "additionalProperties": QUANTITY},
        "claims": {"type": "array"},
    },
}

ENV_VAR = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name"],
    "properties": {
        "name": {"type": "string"},
        "value": {"type": "string"},
        "valueFrom": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "secretKeyRef": {
                    "type": "object", "additionalProperties": False, "required": ["key"],
                    "properties": {"name": {"type": "string"}, "key": {"type": "string"}, "optional": {"type": "boolean"}},
                },
                "configMapKeyRef": {"type": "object"},
                "fieldRef": {"type": "object"},
                "resourceFieldRef": {"type": "object"},
            },
        },
    },
}

VOLUME_MOUNT = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "mountPath"],
    "properties": {
        "name": {"type": "string"}, "mountPath": {"type": "string"}, "readOnly": {"type": "boolean"},
        "subPath": {"type": "string"}, "subPathExpr": {"type": "string"}, "mountPropagation": {"type": "string"},
    },
}

CONTAINER = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name"],
    "properties": {
        "name": {"type": "string"},
        "image": {"type": "string"},
        "imagePullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
        "command": {"type": "array", "items": {"type": "string"}},
        "args": {"type": "array", "items": {"type": "string"}},
        "workingDir": {"type": "string"},
        "env": {"type": "array", "items": ENV_VAR},
        "envFrom": {"type": "array"},
        "ports": {
            "type": "array",
            "items": {
                "type": "object", "additionalProperties": False, "required": ["containerPort"],
                "properties": {
                    "containerPort": {"type": "integer", "minimum": 1, "maximum": 65535}, "name": {"type": "string"},
                    "protocol": {"enum": ["TCP", "UDP", "SCTP"]}, "hostPort": {"type": "integer"},
                    "hostIP": {"type": "string"},
                },
            },
        },
        "resources": RESOURCES,
        "volumeMounts": {"type": "array", "items": VOLUME_MOUNT},
        "volumeDevices": {"type": "array"},
        "livenessProbe": {"type": "object"}, "readinessProbe": {"type": "object"}, "startupProbe": {"type": "object"},
        "lifecycle": {"type": "object"}, "securityContext": {"type": "object"},
        "terminationMessagePath": {"type": "string"}, "terminationMessagePolicy": {"type": "string"},
        "stdin": {"type": "boolean"}, "stdinOnce": {"type": "boolean"}, "tty": {"type": "boolean"},
        "resizePolicy": {"type": "array"}, "restartPolicy": {"type": "string"},
    },
}

VOLUME = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string"},
        "emptyDir": {
            "type": "object", "additionalProperties": False,
            "properties": {"medium": {"type": "string"}, "sizeLimit": QUANTITY},
        },
        "persistentVolumeClaim": {
            "type": "object", "additionalProperties": False, "required": ["claimName"],
            "properties": {"claimName": {"type": "string"}, "readOnly": {"type": "boolean"}},
        },
    },
    # Exactly one volume source besides the name.
    "minProperties": 2,
    "maxProperties": 2,
}

POD_SPEC = {
    "type": "object",
    "required": ["containers"],
    "properties": {
        "containers": {"type": "array", "minItems": 1, "items": CONTAINER},
        "initContainers": {"type": "array", "items": CONTAINER},
        "volumes": {"type": "array", "items": VOLUME},
        "restartPolicy": {"enum": ["Always", "OnFailure", "Never"]},
        "tolerations": {
            "type": "array",
            "items": {
                "type": "object", "additionalProperties": False,
                "properties": {
                    "key": {"type": "string"}, "operator": {"enum": ["Exists", "Equal"]}, "value": {"type": "string"},
                    "effect": {"enum": ["NoSchedule", "PreferNoSchedule", "NoExecute"]},
                    "tolerationSeconds": {"type": "integer"},
                },
            },
        },
        "nodeSelector": STRING_MAP,
        "serviceAccountName": {"type": "string"},
        "affinity": {"type": "object"},
        "imagePullSecrets": {"type": "array"},
        "securityContext": {"type": "object"},
        "priorityClassName": {"type": "string"},
        "schedulerName": {"type": "string"},
    },
    "additionalProperties": False,
}

POD_TEMPLATE = {
    "type": "object",
    "additionalProperties": False,
    "required": ["spec"],
    "properties": {"metadata": {"type": "object"}, "spec": POD_SPEC},
}

# KubeRay: rayStartParams is map[string]string (numbers must be quoted).
RAY_START_PARAMS = STRING_MAP

HEAD_GROUP_SPEC = {
    "type": "object",
    "additionalProperties": False,
    "required": ["template"],
    "properties": {
        "rayStartParams": RAY_START_PARAMS,
        "template": POD_TEMPLATE,
        "serviceType": {"type": "string"},
        "enableIngress": {"type": "boolean"},
        "headService": {"type": "object"},
    },
}

WORKER_GROUP_SPEC = {
    "type": "object",
    "additionalProperties": False,
    "required": ["groupName", "template"],
    "properties": {
        "groupName": {"type": "string"},
        "replicas": {"type": "integer", "minimum": 0},
        "minReplicas": {"type": "integer", "minimum": 0},
        "maxReplicas": {"type": "integer", "minimum": 0},
        "numOfHosts": {"type": "integer", "minimum": 1},
        "rayStartParams": RAY_START_PARAMS,
        "template": POD_TEMPLATE,
        "scaleStrategy": {"type": "object"},
        "suspend": {"type": "boolean"},
        "idleTimeoutSeconds": {"type": "integer"},
    },
}

RAY_CLUSTER_SPEC = {
    "type": "object",
    "additionalProperties": False,
    "required": ["headGroupSpec"],
    "properties": {
        "rayVersion": {"type": "string"},
        "enableInTreeAutoscaling": {"type": "boolean"},
        "autoscalerOptions": {"type": "object"},
        "headServiceAnnotations": STRING_MAP,
        "headGroupSpec": HEAD_GROUP_SPEC,
        "workerGroupSpecs": {"type": "array", "items": WORKER_GROUP_SPEC},
        "suspend": {"type": "boolean"},
        "managedBy": {"type": "string"},
    },
}

RAYJOB = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "ray.io/v1"},
        "kind": {"const": "RayJob"},
        "metadata": {
            "type": "object",
            "properties": {"name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63}},
        },
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["entrypoint"],
            "properties": {
                "entrypoint": {"type": "string", "minLength": 1},
                "runtimeEnvYAML": {"type": "string"},
                "jobId": {"type": "string"},
                "metadata": STRING_MAP,
                "submissionMode": {"enum": ["K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode"]},
                "shutdownAfterJobFinishes": {"type": "boolean"},
                "ttlSecondsAfterFinished": {"type": "integer", "minimum": 0},
                "activeDeadlineSeconds": {"type": "integer", "minimum": 1},
                "backoffLimit": {"type": "integer", "minimum": 0},
                "entrypointNumCpus": {"type": "number"},
                "entrypointNumGpus": {"type": "number"},
                "entrypointResources": {"type": "string"},
                "clusterSelector": STRING_MAP,
                "suspend": {"type": "boolean"},
                "submitterPodTemplate": POD_TEMPLATE,
                "rayClusterSpec": RAY_CLUSTER_SPEC,
            },
        },
    },
}
