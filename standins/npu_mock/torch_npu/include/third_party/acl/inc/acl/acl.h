// Declarations of the ACL names the twinkle_mem glue uses (CANN 8.x acl_base.h / acl_rt.h), for the build check.
#pragma once
#include <stdint.h>

typedef void* aclrtStream;
typedef int aclError;
#define ACL_SUCCESS 0

typedef enum { ACL_FORMAT_NCHW = 0, ACL_FORMAT_NHWC = 1, ACL_FORMAT_ND = 2, ACL_FORMAT_NCDHW = 30 } aclFormat;
typedef enum {
  ACL_DEVICE_INFO_UNDEFINED = -1,
  ACL_DEVICE_INFO_AI_CORE_NUM = 0,
  ACL_DEVICE_INFO_VECTOR_CORE_NUM = 1,
  ACL_DEVICE_INFO_L2_SIZE = 2
} aclDeviceInfo;

#ifdef __cplusplus
extern "C" {
#endif
aclError aclGetDeviceCapability(uint32_t deviceId, aclDeviceInfo deviceInfo, int64_t* value);
const char* aclrtGetSocName();
#ifdef __cplusplus
}
#endif
