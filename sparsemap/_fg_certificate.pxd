# The factor graph's certificate (sparsemap/_fg_certificate.pyx): the polish, the KKT
# check, the Farkas certificate, and the affine projection they share with the backward pass.

from sparsemap._active_set cimport _Workspace
from sparsemap._fg_admm cimport _Admm, _FacetSlot


cdef class _Certified(_Admm):
    cdef double _best(self, _Workspace ws, const double* nu) except? -1 nogil
    cdef int _polish_once(self) except -1 nogil
    cdef int _polish_repair(self, _Workspace ws, int code) except -1 nogil
    cdef int _solve_kappa(self) except -1 nogil
    cdef int _polish_prepare(self, _Workspace ws, Py_ssize_t f) except -1 nogil
    cdef int _polish_check(self, _Workspace ws, Py_ssize_t f) except -1 nogil
    cdef int _polish_accept(self, _Workspace ws, Py_ssize_t f) except -1 nogil
    cdef int _facet_check(self, _FacetSlot s, _Workspace ws, Py_ssize_t f) except -1 nogil
    cdef int _jac(self, _Workspace ws, Py_ssize_t f, const double* in_u, const double* in_v,
                  double* out_u, double* out_v, double* buf, double* scratch_u) except -1 nogil
    cdef int _prop1(self, _Workspace ws, const double* in_u, const double* in_v, double* out_u,
                    double* out_v, double* buf, double* scratch_u) except -1 nogil
    cdef int _R(self, const double* x, double* out, double* buf) except -1 nogil
    cdef int _R_factor(self, _Workspace ws, Py_ssize_t f, const double* x, double* out,
                       double* buf) except -1 nogil
    cdef void _C(self, const double* y, double* out) noexcept nogil
    cdef void _Ct(self, const double* z, double* out) noexcept nogil
    cdef double _residual(self, const double* y, const double* t, double* r, double* tmp,
                          double* buf) except -1 nogil
    cdef Py_ssize_t _project(self, const double* w, const double* t, double* y, double* z,
                             double* r, double* p, double* q, double* tmp, double* a,
                             double* buf, Py_ssize_t max_cg, double* res_out) except -1 nogil
